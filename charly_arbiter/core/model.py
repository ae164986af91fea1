"""The arbiter's vocabulary: claimants, leases and the ledger's contents.

Everything here is a frozen value.  The ledger reads and writes `LedgerState`;
the planner decides over it; nothing in this module touches the outside world.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum

from charly_arbiter.errors import InvalidClaimant

VFIO = "vfio-pci"
HOME = "home"  # how a switch to each function's own home driver is named to people

_KIND = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# Proxmox VE guests (`proxmox:VMID` VMs, `lxc:CTID` containers) are named by the
# VMID Proxmox gives them: 100 to 999999999, written without leading zeros
# (pve-common's pve-vmid format), so that one guest has one claimant name.
_VMID = re.compile(r"[1-9][0-9]{2,8}")
VMID_KINDS = ("proxmox", "lxc")
_MAX_NAME = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def target_label(driver: str) -> str:
    """A switch target as messages and events name it: the driver, or "home" for the
    kernel's own choice (NO_DRIVER, the empty string)."""
    return driver or HOME


def now() -> str:
    """A lease's timestamps: local time with its offset, to the second."""
    return datetime.now(UTC).astimezone().isoformat(timespec="seconds")


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
        if isinstance(text, Claimant):
            return text
        kind, sep, name = str(text).partition(":")
        if not sep:
            raise InvalidClaimant(text, "write it as KIND:NAME, e.g. libvirt:win11")
        if _KIND.fullmatch(kind) is None:
            raise InvalidClaimant(text, "the kind must be a lower-case word such as libvirt")
        if not name or len(name) > _MAX_NAME:
            raise InvalidClaimant(text, f"the name must have 1 to {_MAX_NAME} characters")
        if _CONTROL.search(name):
            raise InvalidClaimant(text, "the name contains control characters")
        if kind == "process" and not name.isdigit():
            raise InvalidClaimant(text, "a process claimant is process:PID")
        if kind in VMID_KINDS and _VMID.fullmatch(name) is None:
            raise InvalidClaimant(
                text, f"a {kind} claimant is {kind}:VMID, a Proxmox VMID from 100 to 999999999"
            )
        return str.__new__(cls, text)

    @classmethod
    def of(cls, kind: str, name: str) -> Claimant:
        return cls.parse(f"{kind}:{name}")

    @property
    def kind(self) -> str:
        return self.partition(":")[0]

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "claimant", Claimant.parse(self.claimant))

    @property
    def owner(self) -> ProcessRef | None:
        """The process carrying out an acquiring or releasing lease (None when active)."""
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
        records = [r if r.holder != record.holder else record for r in self.stopped]
        if all(r.holder != record.holder for r in self.stopped):
            records.append(record)
        return replace(self, stopped=tuple(records))


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

    def with_poison(self, token: str, poison: Poison | None) -> LedgerState:
        poisoned = dict(self.poisoned)
        if poison is None:
            poisoned.pop(token, None)
        else:
            poisoned[token] = poison
        return replace(self, poisoned=tuple(sorted(poisoned.items())))
