"""The arbiter's vocabulary: claimants, leases and the ledger's contents.

Everything here is a frozen value.  The ledger reads and writes `LedgerState`;
the planner decides over it; nothing in this module touches the outside world.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum

from charly_arbiter.core.pci import is_address
from charly_arbiter.errors import InvalidClaimant

VFIO = "vfio-pci"
HOME = "home"  # how a switch to each function's own home driver is named to people

_MAX_NAME = 1024  # characters: a bound for the ledger and for messages, above every kind's own
# Characters no name may have, whatever its kind allows: they cannot be shown in a
# terminal, a log line or a hint as what they are (controls, C1 controls, format
# characters such as a right-to-left override, separators that break lines).
_UNSHOWABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# systemd's unit types (systemd.unit(5)), the suffix every unit name ends with.
UNIT_SUFFIXES = (
    "service", "socket", "device", "mount", "automount", "swap",
    "target", "path", "timer", "slice", "scope",
)  # fmt: skip
# The characters of a unit name before its suffix (systemd's unit_name_is_valid:
# letters, digits and `:-_.\`, plus `@` between a template and its instance).
_UNIT_CHARS = re.compile(r"[A-Za-z0-9:_.\\@-]+")
_UNIT_MAX = 255  # bytes (UNIT_NAME_MAX is 256 with the terminating NUL)
_UNIT_MAX_LONG = 4095  # device, mount and swap units are named after paths (PATH_MAX - 1)
# Podman's and Docker's container names (their own check of a name given with --name).
_CONTAINER = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")


def _libvirt_problem(name: str) -> str | None:
    """libvirt refuses `/` in a domain's name (domain_conf.c: "name %s cannot contain
    '/'") and a newline when a domain is defined (virXMLCheckIllegalChars); anything
    else, spaces and quotes included, is a name libvirt accepts."""
    if "/" in name:
        return "a libvirt domain's name cannot contain '/'"
    return None


def _systemd_problem(name: str) -> str | None:
    """systemd's unit-name grammar: PREFIX[@INSTANCE].TYPE (unit_name_is_valid)."""
    prefix, dot, suffix = name.rpartition(".")
    if not dot or not prefix or suffix not in UNIT_SUFFIXES:
        return f"a unit name ends with its type: .{', .'.join(UNIT_SUFFIXES)}"
    limit = _UNIT_MAX_LONG if suffix in ("device", "mount", "swap") else _UNIT_MAX
    if len(name.encode()) > limit:
        return f"a .{suffix} unit's name has at most {limit} bytes"
    if _UNIT_CHARS.fullmatch(prefix) is None:
        return "a unit name has only letters, digits and : - _ . \\ @ before its type"
    at = prefix.find("@")  # the first one ends the template's name; the instance may have more
    if at == 0:
        return "a unit name cannot start with @"
    if at == len(prefix) - 1:
        return "it is a template, which never runs; name an instance (PREFIX@INSTANCE.TYPE)"
    return None


def _container_problem(name: str) -> str | None:
    if _CONTAINER.fullmatch(name) is None:
        return "a container name is [a-zA-Z0-9][a-zA-Z0-9_.-]* (Podman's and Docker's rule)"
    return None


def _process_problem(name: str) -> str | None:
    if not name.isascii() or not name.isdigit() or int(name) == 0:
        return "a process claimant is process:PID, with PID a process id"
    return None


# Proxmox VE guests (`proxmox:VMID` VMs, `lxc:CTID` containers) are named by the
# VMID Proxmox gives them: 100 to 999999999, written without leading zeros
# (pve-common's pve-vmid format), so that one guest has one claimant name.
_VMID = re.compile(r"[1-9][0-9]{2,8}")


def _vmid_problem(name: str) -> str | None:
    if _VMID.fullmatch(name) is None:
        return "a Proxmox guest is named by its VMID from 100 to 999999999"
    return None


def _persistence_problem(name: str) -> str | None:
    if not is_address(name):
        return "an nvidia-persistence holder is named after its GPU's PCI address"
    return None


class HolderKind(StrEnum):
    """Every kind of claimant or holder (`KIND:NAME`).  The values are what the ledger,
    the configuration, the events and every --json output spell: never change one."""

    LIBVIRT = "libvirt"
    SYSTEMD = "systemd"
    CONTAINER = "container"
    PROCESS = "process"
    NVIDIA_PERSISTENCE = "nvidia-persistence"
    PROXMOX = "proxmox"
    LXC = "lxc"
    ARBITER = "arbiter"
    # The screen of a GPU given up for a VM (`screen = "release"`): the display
    # manager's unit (`display-manager:gdm.service`, started again and checked when
    # the GPU comes home), a logind session (`session:3`, terminated, never started
    # again: the display manager's login screen takes its place) and a user unit of
    # that session's user (`systemd-user:1000/pipewire.service`).
    DISPLAY_MANAGER = "display-manager"
    SESSION = "session"
    SYSTEMD_USER = "systemd-user"


# The arbiter's own operations on a GPU, each a claimant of kind `arbiter` named
# `OPERATION/TOKEN`: changing a physical function's VF count (`vfs`), changing a GPU's
# MIG mode or layout (`mig`).  Their lease lives as long as the process that carries
# the operation out (its writer, by pid and start time), and one GPU has at most one
# of each at a time (a second finds the first's lease).
ARBITER_OPERATIONS = ("vfs", "mig")
_TOKEN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _arbiter_problem(name: str) -> str | None:
    operation, slash, token = name.partition("/")
    if not slash or operation not in ARBITER_OPERATIONS or _TOKEN_NAME.fullmatch(token) is None:
        operations = ", ".join(ARBITER_OPERATIONS)
        return f"the arbiter's own claimants are OPERATION/TOKEN, OPERATION one of {operations}"
    return None


def operation_claimant(operation: str, token: str) -> Claimant:
    """The claimant of the arbiter's own `operation` on `token` (`arbiter:vfs/gpu0`)."""
    return Claimant.of(HolderKind.ARBITER, f"{operation}/{token}")


# logind's session ids (session_id_valid: letters and digits), "3", "c1".
_SESSION = re.compile(r"[A-Za-z0-9]{1,64}")


def _session_problem(name: str) -> str | None:
    if _SESSION.fullmatch(name) is None:
        return "a logind session is named by its id: letters and digits (session:3)"
    return None


def _display_manager_problem(name: str) -> str | None:
    problem = _systemd_problem(name)
    if problem is None and not name.endswith(".service"):
        return "a display manager is the service unit that runs it (gdm.service)"
    return problem


def _user_unit_problem(name: str) -> str | None:
    uid, slash, unit = name.partition("/")
    if not slash or not uid.isascii() or not uid.isdigit() or len(uid) > 10:
        return "a user unit is UID/UNIT (systemd-user:1000/pipewire.service)"
    return _systemd_problem(unit)


# The kinds a screen's release stops, in the order it stops them (the user units
# holding the GPU, the sessions on it, the display manager); each comes back (or is
# said not to) in the opposite order.
SCREEN_KINDS = (HolderKind.SYSTEMD_USER, HolderKind.SESSION, HolderKind.DISPLAY_MANAGER)


def user_unit(uid: int, unit: str) -> Claimant:
    """`systemd-user:UID/UNIT`."""
    return Claimant.of(HolderKind.SYSTEMD_USER, f"{uid}/{unit}")


# The rules of what each kind names.
KINDS = {
    HolderKind.LIBVIRT: _libvirt_problem,
    HolderKind.SYSTEMD: _systemd_problem,
    HolderKind.CONTAINER: _container_problem,
    HolderKind.PROCESS: _process_problem,
    HolderKind.NVIDIA_PERSISTENCE: _persistence_problem,
    HolderKind.PROXMOX: _vmid_problem,
    HolderKind.LXC: _vmid_problem,
    HolderKind.ARBITER: _arbiter_problem,
    HolderKind.DISPLAY_MANAGER: _display_manager_problem,
    HolderKind.SESSION: _session_problem,
    HolderKind.SYSTEMD_USER: _user_unit_problem,
}
# nvidia-persistence and the screen's kinds are holders the host finds by itself, never
# claimants a person names; arbiter is the arbiter's own operations, claimants no holder
# source is asked of and no person names; every other kind is both (and a holder source
# answers for it).
CLAIMANT_KINDS = tuple(
    kind
    for kind in HolderKind
    if kind not in (HolderKind.NVIDIA_PERSISTENCE, HolderKind.ARBITER, *SCREEN_KINDS)
)


class ProcessPolicy(StrEnum):
    """`device_holder_policy`: a process that holds a GPU's node refuses the claim, or
    is terminated (SIGTERM, then SIGKILL)."""

    REFUSE = "refuse"
    TERMINATE = "terminate"


class Preemption(StrEnum):
    """`libvirt_preemption`, `[proxmox] preemption`: a VM's start may stop another VM
    that holds its GPU, or is refused."""

    STOP = "stop"
    REFUSE = "refuse"


class ConsolePolicy(StrEnum):
    """`console`: a GPU that drives the host's console or display is refused, or the
    console is taken off it (and given back when the GPU comes home)."""

    REFUSE = "refuse"
    RELEASE = "release"


class ScreenPolicy(StrEnum):
    """`screen`: a GPU whose screen someone uses (a display manager, a graphical
    session, a compositor) is refused, naming them, or they are stopped before it
    leaves and the display manager started again when it comes home.  `release`
    implies `console = "release"`."""

    REFUSE = "refuse"
    RELEASE = "release"


class SleepPolicy(StrEnum):
    """`sleep`: while a GPU is passed through the host may not suspend (a logind
    inhibitor lock is held), or it may."""

    BLOCK = "block"
    ALLOW = "allow"


def target_label(driver: str) -> str:
    """A switch target as messages and events name it: the driver, or "home" for the
    kernel's own choice (NO_DRIVER, the empty string)."""
    return driver or HOME


def now() -> str:
    """A lease's timestamps: local time with its offset, to the second."""
    return datetime.now(UTC).astimezone().isoformat(timespec="seconds")


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def human_time(moment: str | datetime) -> str:
    """The one way a time is shown to a person (status, explain, history, refusals,
    doctor): local time to the second, `2026-11-29 15:26:44`.  Machine outputs
    (`--json`, the ledger) keep ISO 8601 with the offset.  A text that is not a
    time is shown as it is; a time without a zone is taken as UTC."""
    when = as_time(moment)
    if when is None:
        return str(moment) or "an unknown time"
    return when.astimezone().strftime(TIME_FORMAT)


def as_time(moment: str | datetime) -> datetime | None:
    """A time with its zone (UTC where it has none); None for a text that is not one."""
    if isinstance(moment, str):
        try:
            moment = datetime.fromisoformat(moment)
        except ValueError:
            return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class Mode(StrEnum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"


class LeaseState(StrEnum):
    """Where a lease is in its intent journal.

    ACQUIRING and RELEASING are written *before* the outside world is touched,
    so a crash at any point leaves the plan on disk for `restore`.
    """

    ACQUIRING = "acquiring"
    ACTIVE = "active"
    RELEASING = "releasing"


class StepState(StrEnum):
    """A step of an intent: a switch or a holder's stop, planned then done.

    A stopped holder's record is STARTING while the lease that owns it starts
    the holder again: an exclusive claim that wants one of the holder's tokens
    then waits instead of taking the record over (see planner.decide_claim).
    """

    PLANNED = "planned"
    DONE = "done"
    STARTING = "starting"


@dataclass(frozen=True, order=True)
class ProcessRef:
    """A process, told apart from a later one that reuses its pid.

    `start` is the process's start time in clock ticks since boot
    (`/proc/PID/stat` field 22); 0 means unknown (a ledger from before it was
    recorded), in which case only the pid and its state can be checked.
    """

    pid: int
    start: int = 0

    def __str__(self) -> str:
        return f"{self.pid}" if not self.start else f"{self.pid} (started at tick {self.start})"


class Claimant(str):
    """Who claims or holds a GPU, written `KIND:NAME` (`libvirt:win11`, `process:1234`).

    A string (it is written as one in the ledger, in messages and on the command
    line) that can only be made by `parse`, so every one in the program has been
    checked once, and that knows its parts: no caller splits it on `:` again.
    """

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> Claimant:
        """`KIND:NAME`, the name checked by the rules of what its kind names (a libvirt
        domain, a systemd unit, a container, a process), or `InvalidClaimant`."""
        if isinstance(text, Claimant):
            return text
        kind, sep, name = str(text).partition(":")
        if not sep:
            raise InvalidClaimant(text, "write it as KIND:NAME, e.g. libvirt:win11")
        try:
            rules = KINDS[HolderKind(kind)]
        except ValueError:
            raise InvalidClaimant(text, f"the kind is one of {', '.join(CLAIMANT_KINDS)}") from None
        # (systemd's own bound is in bytes, and longer for units named after paths)
        if not name or (kind != HolderKind.SYSTEMD and len(name) > _MAX_NAME):
            raise InvalidClaimant(text, f"the name must have 1 to {_MAX_NAME} characters")
        if any(unicodedata.category(c) in _UNSHOWABLE for c in name):
            raise InvalidClaimant(text, "the name contains control characters")
        problem = rules(name)
        if problem is not None:
            raise InvalidClaimant(text, problem)
        return str.__new__(cls, text)

    @classmethod
    def of(cls, kind: str, name: str) -> Claimant:
        return cls.parse(f"{kind}:{name}")

    @property
    def kind(self) -> HolderKind:
        return HolderKind(self.partition(":")[0])

    @property
    def name(self) -> str:
        return self.partition(":")[2]


@dataclass(frozen=True)
class StoppedHolder:
    """A holder a lease stopped (or will stop) and must bring back.

    `shared_tokens` is set when the holder was itself a shared claimant: its
    lease moved into this record, and is recreated when it comes back.
    """

    holder: Claimant
    state: StepState = StepState.PLANNED
    shared_tokens: tuple[str, ...] = ()
    restored: bool = False
    # The tokens the holder used when it was stopped: whoever holds one of them
    # exclusively when it would come back keeps it stopped instead.
    tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "holder", Claimant.parse(self.holder))


@dataclass(frozen=True)
class Lease:
    claimant: Claimant
    mode: Mode
    tokens: tuple[str, ...]
    state: LeaseState
    transient: bool
    boot_id: str
    created: str
    owner_pid: int = 0
    owner_start: int = 0
    stopped: tuple[StoppedHolder, ...] = ()
    # token -> StepState of its driver switch (planned while acquiring/releasing)
    switched: tuple[tuple[str, StepState], ...] = ()
    note: str = ""
    # The tokens whose sleep lock (a logind inhibitor, core/sleeplocks.py) this lease
    # holds: recorded before the lock is taken, forgotten once it is let go.
    sleep_locks: tuple[str, ...] = ()
    sleep_lock_error: str = ""  # why the host could not take one (no systemd), if it could not

    def __post_init__(self) -> None:
        object.__setattr__(self, "claimant", Claimant.parse(self.claimant))

    @property
    def is_operation(self) -> bool:
        """A lease of the arbiter's own operation (`arbiter:vfs/gpu0`): it lives as long
        as its writer, whatever its state."""
        return self.claimant.kind == "arbiter"

    @property
    def owner(self) -> ProcessRef | None:
        """The process carrying out an acquiring or releasing lease (None when active,
        but for the arbiter's own operations, which keep theirs)."""
        return ProcessRef(self.owner_pid, self.owner_start) if self.owner_pid > 0 else None

    def owned_by(self, owner: ProcessRef | None) -> Lease:
        """The same lease with `owner` as its writer (None: nobody, once active)."""
        if owner is None:
            return replace(self, owner_pid=0, owner_start=0)
        return replace(self, owner_pid=owner.pid, owner_start=owner.start)

    def unrestored(self) -> tuple[StoppedHolder, ...]:
        """The holders this lease stopped and has not brought back (or handed on) yet."""
        return tuple(record for record in self.stopped if not record.restored)

    def switch_state(self, token: str) -> StepState | None:
        return dict(self.switched).get(token)

    def with_switch(self, token: str, state: StepState) -> Lease:
        steps = dict(self.switched)
        steps[token] = state
        return replace(self, switched=tuple(sorted(steps.items())))

    def with_stopped(self, record: StoppedHolder) -> Lease:
        """The record of `record.holder` changed in its place, or added last.  One this
        lease brought back already and records again (handed to it) goes last too:
        holders come back newest first, so the order is what the lease did."""
        old = next((r for r in self.stopped if r.holder == record.holder), None)
        if old is not None and not (old.restored and not record.restored):
            return replace(self, stopped=tuple(record if r is old else r for r in self.stopped))
        kept = tuple(r for r in self.stopped if r is not old)
        return replace(self, stopped=(*kept, record))


def blocks_token(lease: Lease, token: str) -> bool:
    """Whether `lease` still holds `token` (a releasing lease lets go token by token)."""
    if token not in lease.tokens:
        return False
    return not (lease.state is LeaseState.RELEASING and lease.switch_state(token) is StepState.DONE)


@dataclass(frozen=True)
class Poison:
    reason: str
    since: str


@dataclass(frozen=True)
class LedgerState:
    """The whole ledger.  `homes` maps token -> {address: home driver}, recorded
    the first time a token is seen so that it can always be sent home."""

    generation: int = 0
    leases: tuple[Lease, ...] = ()
    homes: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    poisoned: tuple[tuple[str, Poison], ...] = ()

    def lease_of(self, claimant: str) -> Lease | None:
        return next((lease for lease in self.leases if lease.claimant == claimant), None)

    def leases_on(self, token: str) -> list[Lease]:
        return [lease for lease in self.leases if token in lease.tokens]

    def home_of(self, token: str) -> dict[str, str]:
        return dict(dict(self.homes).get(token, ()))

    def poison_of(self, token: str) -> Poison | None:
        return dict(self.poisoned).get(token)

    def with_lease(self, lease: Lease) -> LedgerState:
        others = tuple(item for item in self.leases if item.claimant != lease.claimant)
        return replace(self, leases=(*others, lease))

    def without_lease(self, claimant: str) -> LedgerState:
        return replace(self, leases=tuple(x for x in self.leases if x.claimant != claimant))

    def with_home(self, token: str, home: dict[str, str]) -> LedgerState:
        homes = dict(self.homes)
        homes[token] = tuple(sorted(home.items()))
        return replace(self, homes=tuple(sorted(homes.items())))

    def without_home(self, token: str) -> LedgerState:
        return replace(self, homes=tuple(item for item in self.homes if item[0] != token))

    def with_poison(self, token: str, poison: Poison | None) -> LedgerState:
        poisoned = dict(self.poisoned)
        if poison is None:
            poisoned.pop(token, None)
        else:
            poisoned[token] = poison
        return replace(self, poisoned=tuple(sorted(poisoned.items())))
