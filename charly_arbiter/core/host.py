"""The host interface: every outside effect the arbiter has goes through it.

Two hosts implement it: `local` (sysfs, /proc, libvirt, systemctl, container
CLIs) and `sim:DIR` (a file-backed simulation).  The arbiter's rules never
import either; they receive a `Host`.

Holders are named by their claimant string (`systemd:ollama.service`,
`libvirt:win11`, `process:4242`), so that a lease can record whom it stopped
and a later process (`restore`, after a crash) can bring them back knowing
only that name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from charly_arbiter.core.model import Claimant, ConsolePolicy, ProcessRef, ScreenPolicy
from charly_arbiter.core.pci import slot_of, vf_address
from charly_arbiter.errors import cli_command

# Switch targets: a driver name, or NO_DRIVER for "not vfio-pci, whatever the
# kernel binds" (a function that had no driver when the token was first seen).
NO_DRIVER = ""


@dataclass(frozen=True)
class Sriov:
    """A physical function's SR-IOV side: how many virtual functions it can have,
    and those it has now (the kernel's `virtfnN` links, in index order).

    The count is the links, not `sriov_numvfs`: reading that attribute takes the
    device lock, and blocks for as long as a change of the count is stuck in the
    kernel (a VF held through VFIO), which would hang every command that looks at
    the GPU.  While a teardown is under way the links go one by one, so `vfs` may
    be fewer than the count the kernel will report once it is done.
    """

    total_vfs: int
    vfs: tuple[str, ...] = ()
    # Where the kernel puts the VFs (`sriov_offset`, `sriov_stride`): a VF's address is
    # known before it exists, and after its `physfn` link is gone (a stuck teardown).
    offset: int = 1
    stride: int = 1

    @property
    def num_vfs(self) -> int:
        return len(self.vfs)

    def possible(self, physfn: str) -> tuple[str, ...]:
        """Every address a VF of the physical function at `physfn` can have."""
        return tuple(
            vf_address(physfn, index, self.offset, self.stride) for index in range(self.total_vfs)
        )


# A switch target for NVIDIA's vGPU on a virtual function: the VF stays on `nvidia`
# and is given vGPU type ID (`nvidia/current_vgpu_type`), where another VF would go
# to vfio-pci.
VGPU = "vgpu:"


def vgpu_target(type_id: int) -> str:
    return f"{VGPU}{type_id}"


def vgpu_type_of(target: str) -> int | None:
    """The vGPU type a switch target asks for (None: a driver, not a vGPU type)."""
    return int(target[len(VGPU) :]) if target.startswith(VGPU) else None


@dataclass(frozen=True)
class Vgpu:
    """An NVIDIA vGPU virtual function's side, as NVIDIA's vGPU software 17 and later
    lays it out on GPUs that have no mdev (Ada, Hopper and newer) under the VF's
    sysfs directory, in `nvidia/` (NVIDIA Virtual GPU Software User Guide, "Creating
    an NVIDIA vGPU on a Linux with KVM Hypervisor that Uses a Vendor-Specific VFIO
    Framework"): `creatable_vgpu_types` lists the types the VF can be given *now*,
    one `ID : name` a line (fewer once other VFs have types: a GPU runs one kind at a
    time unless it is in mixed mode), and `current_vgpu_type` holds the type it has
    (0: none); writing an ID there creates the vGPU, writing 0 removes it.  The VF
    stays on `nvidia` all along: bound to vfio-pci it is refused (EINVAL)."""

    creatable: tuple[tuple[int, str], ...] = ()
    current: int = 0

    def find(self, wanted: str) -> tuple[int, str] | None:
        """The creatable type named `wanted`: its ID, or its name (any case)."""
        for type_id, name in self.creatable:
            if wanted.strip() == str(type_id) or wanted.strip().lower() == name.lower():
                return type_id, name
        return None

    def listed(self) -> str:
        return ", ".join(f"{name} ({type_id})" for type_id, name in self.creatable) or "none"


def parse_vgpu_types(text: str) -> tuple[tuple[int, str], ...]:
    """`creatable_vgpu_types` as NVIDIA's guide shows it (`ID : vGPU Name` under a
    header line), and, leniently, `name ID` lines as other tools lay it out."""
    found = []
    for line in text.splitlines():
        left, colon, right = line.partition(":")
        if colon and left.strip().isdigit():
            found.append((int(left.strip()), right.strip()))
            continue
        words = line.split()
        if len(words) >= 2 and words[-1].isdigit():
            found.append((int(words[-1]), " ".join(words[:-1])))
    return tuple(found)


@dataclass(frozen=True)
class MigInstance:
    """One MIG device of a GPU (a compute instance in its GPU instance), as NVML lists
    it: `index` is the MIG device's index under its GPU, which NVIDIA's CDI spec
    generator puts in its names (`nvidia.com/gpu=GPU:INDEX`)."""

    index: int
    gpu_instance: int
    compute_instance: int
    uuid: str  # MIG-...
    profile: str  # 1g.10gb, 3g.40gb, ...


@dataclass(frozen=True)
class MigState:
    """A MIG-capable GPU's mode (and the mode it takes at its next reset, when that
    differs), its NVML index and its instances."""

    enabled: bool
    pending: bool
    index: int
    instances: tuple[MigInstance, ...] = ()

    def instance(self, index: int) -> MigInstance | None:
        return next((i for i in self.instances if i.index == index), None)


@dataclass(frozen=True)
class MigChange:
    """What `mig TOKEN` asks: MIG mode on or off, or a layout (its instances' profiles,
    each a GPU instance with one compute instance that takes all of it)."""

    enabled: bool | None = None
    layout: tuple[str, ...] | None = None

    def __str__(self) -> str:
        if self.layout is not None:
            return "layout " + (",".join(self.layout) or "(none)")
        return "on" if self.enabled else "off"


def sriov_enabled_why(count: int) -> str:
    """Why vfio-pci did not take a physical function: its probe refuses one with
    virtual functions ("Cannot bind to PF with SR-IOV enabled", seen on Linux 6.1),
    which only the kernel's log says."""
    return (
        f"vfio-pci does not take a physical function with SR-IOV enabled ({count} virtual "
        "function(s)); set its sriov_numvfs to 0 first"
    )


@dataclass(frozen=True)
class PciFunction:
    address: str
    vendor: str  # "10de"
    device: str  # "2684"
    pci_class: str  # "030000"
    driver: str | None
    iommu_group: str | None
    # The driver this host would bind the function to by itself (from the kernel's
    # module index and the data file), worked out only where it is needed: for a
    # function found on vfio-pci or on no driver, whose home may be recorded nowhere.
    default_driver: str | None = None
    # SR-IOV: a virtual function names its physical function (`physfn`); a function
    # that can have virtual functions says how many and which (None: it cannot).
    physfn: str | None = None
    sriov: Sriov | None = None
    vgpu: Vgpu | None = None  # an NVIDIA vGPU virtual function (see Vgpu)

    @property
    def is_display(self) -> bool:
        return self.pci_class.startswith("03")

    @property
    def is_virtual(self) -> bool:
        """A virtual function: it exists only while its physical function has it
        enabled, and is never a GPU of its own."""
        return self.physfn is not None


@dataclass(frozen=True)
class TokenSpec:
    """A configured token: the GPU's address and every function of its IOMMU group."""

    name: str
    address: str
    functions: tuple[PciFunction, ...]
    home_driver: str | None = None  # from the configuration, when the operator set one
    cdi: bool = True
    console: ConsolePolicy = ConsolePolicy.REFUSE  # a GPU driving the console
    # A GPU whose screen someone uses (a display manager, a graphical session, a
    # compositor): refused, or those stopped first (`screen = "release"`).
    screen: ScreenPolicy = ScreenPolicy.REFUSE
    # A token configured on a virtual function, whose physical function's token (its
    # `sriov_offset` and `sriov_stride`) places it there: that PF's address.  Known
    # whether the VF exists now or not; its `functions` are empty while it does not.
    vf_of: str | None = None
    # For an NVIDIA vGPU virtual function: the vGPU type (ID or name) its exclusive
    # claim gives it, in place of passing it through on vfio-pci.
    vgpu_type: str | None = None

    @property
    def primary(self) -> PciFunction | None:
        """The function at the token's own address (None: it does not exist now)."""
        return next((f for f in self.functions if f.address == self.address), None)

    @property
    def physical_function(self) -> str | None:
        """For a token on a virtual function: the physical function it belongs to."""
        primary = next((f for f in self.functions if f.address == self.address), None)
        physfn = primary.physfn if primary is not None else None
        return physfn or self.vf_of

    @property
    def label(self) -> str:
        """How refusals name it: `gpu0 (0000:0a:00.0)`."""
        return f"{self.name} ({self.address})"

    @property
    def absent(self) -> bool:
        """A token on a virtual function that does not exist now (its PF has fewer VFs)."""
        return not self.functions

    @property
    def virtual_functions(self) -> tuple[str, ...]:
        """The virtual functions the token's functions have enabled now."""
        return tuple(vf for f in self.functions if f.sriov is not None for vf in f.sriov.vfs)

    def foreign_functions(self) -> tuple[PciFunction, ...]:
        """Members of the GPU's IOMMU group that are not functions of the GPU itself
        (another slot: a NIC or a second card behind a switch without ACS).  An
        exclusive claim would take them from the host too, so it is refused."""
        slot = slot_of(self.address)
        return tuple(f for f in self.functions if slot_of(f.address) != slot)


def common_blocker(token: TokenSpec) -> Blocker | None:
    """The reasons any host shares: no IOMMU group, or a group shared with other devices."""
    for function in token.functions:
        if function.iommu_group is None:
            return Blocker(
                f"the IOMMU is off ({function.address} has no IOMMU group)",
                "enable VT-d or AMD-Vi in the firmware and boot with intel_iommu=on "
                f"(or amd_iommu=on), then run {cli_command('doctor')}",
            )
    foreign = token.foreign_functions()
    if foreign:
        names = ", ".join(f"{f.address} (class {f.pci_class})" for f in foreign)
        return Blocker(
            f"its IOMMU group {token.functions[0].iommu_group} also holds {names}, "
            "which would have to leave the host with it",
            "put the card in a slot with an IOMMU group of its own "
            f"({cli_command('detect')} shows the groups)",
        )
    return None


@dataclass(frozen=True)
class Holder:
    """Something that uses a token right now or may use it (a VM, a unit, a process).

    `how` says how it would be stopped (shown by `plan`); `restartable` is false
    for things that cannot be brought back, such as a terminated process.
    `passthrough` is true for a holder that has the GPU passed through (a VM's
    PCI hostdev): it needs the GPU off its home driver, so nothing shares the GPU
    beside it; every other holder uses the GPU on its home driver, beside shared
    claimants.  `made_preemptible` says how an operator lets claims stop it, where
    that is not arbiter.toml (a refusal shows it).
    """

    ref: Claimant
    tokens: tuple[str, ...]
    preemptible: bool
    running: bool
    how: str = "stop"
    detail: str = ""
    restartable: bool = True
    passthrough: bool = False
    made_preemptible: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ref", Claimant.parse(self.ref))


@dataclass(frozen=True)
class DeviceUser:
    """A process that has one of a token's device nodes open now, and the holder
    (a unit, a container) it runs in where that is known."""

    pid: int
    command: str
    node: str
    token: str
    owner: Claimant | None = None

    def __str__(self) -> str:
        of = f" of {self.owner}" if self.owner else ""
        return f"pid {self.pid} ({self.command}){of} has {self.node} open"


@dataclass(frozen=True)
class ScreenProcess:
    """A process with one of a token's DRM nodes open that belongs to the screen: it
    has a card (primary) node open, or it runs in a graphical or seated logind
    session, or in the user units of such a session's user.  (A system service that
    only renders on the GPU is a holder like any other, not the screen.)"""

    pid: int
    comm: str
    uid: int
    nodes: tuple[str, ...]  # ("card0",) / ("renderD128",)
    session: str | None  # its logind session id, if any
    # Its systemd unit: "charly-weston.service", "session-3.scope",
    # "user@1000.service/app.slice/pipewire.service".
    unit: str | None

    def describe(self) -> str:
        """`weston (pid 812)`."""
        return f"{self.comm} (pid {self.pid})"


@dataclass(frozen=True)
class ScreenSession:
    """A logind session one of a token's screen processes belongs to
    (/run/systemd/sessions/ID)."""

    id: str
    seat: str | None  # "seat0"
    type: str  # "wayland" | "x11" | "tty" | "mir" | "unspecified"
    uid: int
    user: str
    leader: int
    # The system unit that opened it (its leader's INVOCATION_ID), e.g. "gdm.service":
    # `SERVICE=` in the session's file is the PAM service ("login"), not the unit.
    display_manager: str | None

    def describe(self) -> str:
        """`the wayland session of alice, uid 1000 (session 3)`."""
        who = f"{self.user}, uid {self.uid}" if self.user else f"uid {self.uid}"
        return f"the {self.type} session of {who} (session {self.id})"


@dataclass(frozen=True)
class ScreenUse:
    """Who uses the screen of one token: the firmware's boot display, the framebuffer
    console, and the processes, logind sessions, display manager and user units that
    have its DRM nodes open."""

    token: str
    boot_vga: bool  # the firmware booted on it
    fbcon: bool  # the framebuffer console draws on it
    processes: tuple[ScreenProcess, ...] = ()
    sessions: tuple[ScreenSession, ...] = ()
    # The display manager's real unit name (display-manager.service is an alias) when
    # it, or sessions it opened, hold the card.
    display_manager: str | None = None
    # The user units of those sessions' users that hold it ("user@1000.service: pipewire.service").
    user_units: tuple[str, ...] = ()

    @property
    def drives_screen(self) -> bool:
        return self.boot_vga or self.fbcon or bool(self.processes)

    @property
    def seats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.seat for s in self.sessions if s.seat))

    @property
    def users(self) -> tuple[str, ...]:
        """The people whose sessions would end: `alice (uid 1000)`."""
        named = (f"{s.user} (uid {s.uid})" if s.user else f"uid {s.uid}" for s in self.sessions)
        return tuple(dict.fromkeys(named))

    def unsessioned(self) -> tuple[ScreenProcess, ...]:
        """Its processes that are in no session and no user unit (a display server the
        display manager's unit runs itself, a compositor started by a system unit)."""
        return tuple(
            p
            for p in self.processes
            if p.session is None and not (p.unit or "").startswith("user@")
        )

    def holders(self) -> tuple[str, ...]:
        """What uses it, in words: the display manager, each session, the processes in
        none, the user units."""
        parts: list[str] = []
        if self.display_manager:
            parts.append(self.display_manager)
        parts.extend(session.describe() for session in self.sessions)
        for process in self.unsessioned():
            if process.unit and process.unit == self.display_manager:
                continue
            of = f" of {process.unit}" if process.unit else ""
            parts.append(f"{process.describe()}{of}")
        if self.user_units:
            parts.append(f"the user units {', '.join(self.user_units)}")
        return tuple(parts)

    def describe(self) -> str:
        """`gpu0 drives seat0: gdm.service, the wayland session of alice, uid 1000
        (session 3)`, then the boot display and the console where they are on it."""
        if not self.drives_screen:
            return f"{self.token} drives no screen"
        where = ", ".join(self.seats) or "the host's screen"
        extras = []
        if self.boot_vga:
            extras.append("it is the boot display")
        if self.fbcon:
            extras.append("the text console runs on it")
        holders = ", ".join(self.holders())
        text = f"{self.token} drives {where}"
        if holders:
            text += f": {holders}"
        if extras:
            text += (": " if not holders else "; ") + "; ".join(extras)
        return text

    def as_json(self) -> dict[str, object]:
        """What --json outputs show of it."""
        return {
            "token": self.token,
            "drives_screen": self.drives_screen,
            "boot_vga": self.boot_vga,
            "fbcon": self.fbcon,
            "display_manager": self.display_manager,
            "seats": list(self.seats),
            "sessions": [
                {
                    "id": s.id,
                    "seat": s.seat,
                    "type": s.type,
                    "uid": s.uid,
                    "user": s.user,
                    "leader": s.leader,
                    "display_manager": s.display_manager,
                }
                for s in self.sessions
            ],
            "processes": [
                {
                    "pid": p.pid,
                    "comm": p.comm,
                    "uid": p.uid,
                    "nodes": list(p.nodes),
                    "session": p.session,
                    "unit": p.unit,
                }
                for p in self.processes
            ],
            "user_units": list(self.user_units),
            "text": self.describe(),
        }


# What `Host.device_functions` says of a GPU driver's node whose function it
# cannot name now (its GPU is not bound to that driver: on vfio-pci, perhaps a token's).
UNKNOWN_FUNCTION = ""


@dataclass(frozen=True)
class Blocker:
    """Why this host cannot pass a GPU through at all, and what would fix it."""

    why: str
    hint: str


class Host(Protocol):
    """What the arbiter needs from a machine.  Every method may raise `ArbiterError`."""

    description: str

    def boot_id(self) -> str:
        """Changes on every boot; leases from an earlier boot are stranded."""
        ...

    def gpus(self) -> Sequence[PciFunction]:
        """Display-class functions, for the default tokens when none are configured."""
        ...

    def token_functions(self, name: str, address: str) -> Sequence[PciFunction]:
        """The GPU at `address` and every other endpoint of its IOMMU group."""
        ...

    def switch(self, token: TokenSpec, targets: Mapping[str, str]) -> None:
        """Bind each function (address -> driver) all-or-nothing, then verify.

        Raises `SwitchFailed` (or `SwitchHung` from the watchdog); the caller
        poisons the token.  Never hangs past the configured switch timeout.
        """
        ...

    def write_vf_count(self, address: str, count: int) -> None:
        """Write `count` to the physical function's `sriov_numvfs`, as the kernel takes it.

        Raises `VfCountFailed` with the kernel's errno, or `VfCountHung` when the write
        did not return within the switch timeout: it stays stuck in the kernel (a VF's
        VFIO device held open), in a helper process, and nothing more is written to the
        device from this process."""
        ...

    def mig(self, token: TokenSpec) -> MigState | None:
        """The token's GPU's MIG mode and instances (None: it has no MIG, or NVML cannot
        say; `mig_error` then says why)."""
        ...

    def set_mig(self, token: TokenSpec, change: MigChange) -> MigState:
        """Change the GPU's MIG mode or layout (every client of the GPU must be gone);
        raises `MigFailed` with what NVML said."""
        ...

    def holders(self, tokens: Sequence[TokenSpec]) -> Sequence[Holder]:
        """Every known holder of any of these tokens, running or not."""
        ...

    def is_running(self, ref: Claimant) -> bool:
        """Whether a holder or claimant is alive (VM running, process present)."""
        ...

    def are_running(self, refs: Sequence[Claimant]) -> dict[Claimant, bool]:
        """`is_running` of many at once, in one pass where the host can (status asks
        about every lease's claimant)."""
        ...

    def stop(self, ref: Claimant) -> None: ...

    def start(self, ref: Claimant) -> None: ...

    def device_users(self, tokens: Sequence[TokenSpec]) -> Sequence[DeviceUser]:
        """Every process that has a device node of one of `tokens` open now (what a
        drained holder must have let go of before the switch)."""
        ...

    def device_functions(self, numbers: Sequence[tuple[int, int]]) -> Mapping[tuple[int, int], str]:
        """Which PCI function each character device (major, minor) is a node of.

        Only GPU nodes are answered: a DRM card or render node, an NVIDIA
        `/dev/nvidiaN`.  UNKNOWN_FUNCTION says it is a GPU driver's node whose
        function is not bound to that driver now; other numbers are left out.
        (A container's spec names its devices by number: this is how the OCI
        hook finds the GPUs a container is given.)
        """
        ...

    def screen(self, token: TokenSpec) -> ScreenUse:
        """Who uses the token's screen now: boot display, framebuffer console, the
        processes with its DRM nodes open and their sessions, display manager and
        user units (a snapshot, read again before every claim)."""
        ...

    def tell(self, sessions: Sequence[Claimant], message: str) -> None:
        """Tell the people in these logind sessions (`session:ID`) why their session is
        about to end (a notification on their desktop, a line on their terminal); best
        effort, within a few seconds: it never raises."""
        ...

    def passthrough_blocker(self, token: TokenSpec) -> Blocker | None:
        """What keeps the token from being passed through (no IOMMU, no vfio-pci,
        an IOMMU group shared with other devices), checked before anything is
        stopped; None when nothing does."""
        ...

    def current_process(self) -> ProcessRef:
        """This process, as a lease records its writer."""
        ...

    def process_alive(self, process: ProcessRef) -> bool:
        """Whether that very process still runs (pid and start time: a reused pid
        or a zombie is not it)."""
        ...

    def regenerate_cdi(self, token: TokenSpec) -> None:
        """Refresh the CDI spec after the token came home (no-op where there is none)."""
        ...

    def inhibit(self, token: str, why: str) -> None:
        """Hold a logind inhibitor lock for `token` (what=sleep, who=charly-arbiter,
        mode=block) that says `why`, until `uninhibit`: it outlives this process, and
        replaces a lock of `token`'s held already.  Raises `HostError` where it cannot
        (no systemd); the arbiter records that and goes on."""
        ...

    def uninhibit(self, token: str) -> None:
        """Let go of `token`'s sleep lock; nothing when none is held."""
        ...

    def inhibitors(self) -> Mapping[str, str]:
        """The sleep locks the arbiter holds now: token -> why."""
        ...

    def sleep_lock_unavailable(self) -> str | None:
        """Why this host cannot hold a sleep lock (None: it can)."""
        ...

    def close(self) -> None:
        """Release what the host holds open (NVML holds /dev/nvidia* itself)."""
        ...
