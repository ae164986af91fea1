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

from charly_arbiter.core.model import Claimant, ProcessRef
from charly_arbiter.core.pci import slot_of

# Switch targets: a driver name, or NO_DRIVER for "not vfio-pci, whatever the
# kernel binds" (a function that had no driver when the token was first seen).
NO_DRIVER = ""


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

    @property
    def is_display(self) -> bool:
        return self.pci_class.startswith("03")


@dataclass(frozen=True)
class TokenSpec:
    """A configured token: the GPU's address and every function of its IOMMU group."""

    name: str
    address: str
    functions: tuple[PciFunction, ...]
    home_driver: str | None = None  # from the configuration, when the operator set one
    cdi: bool = True
    console: str = "refuse"  # a GPU driving the console: refuse, or "release" the console

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
                "(or amd_iommu=on), then run `charly-arbiter doctor`",
            )
    foreign = token.foreign_functions()
    if foreign:
        names = ", ".join(f"{f.address} (class {f.pci_class})" for f in foreign)
        return Blocker(
            f"its IOMMU group {token.functions[0].iommu_group} also holds {names}, "
            "which would have to leave the host with it",
            "put the card in a slot with an IOMMU group of its own "
            "(`charly-arbiter detect` shows the groups)",
        )
    return None


@dataclass(frozen=True)
class Holder:
    """Something that uses a token right now or may use it (a VM, a unit, a process).

    `how` says how it would be stopped (shown by `plan`); `restartable` is false
    for things that cannot be brought back, such as a terminated process;
    `made_preemptible` says how an operator lets claims stop it, where that is
    not arbiter.toml (a refusal shows it).
    """

    ref: Claimant
    tokens: tuple[str, ...]
    preemptible: bool
    running: bool
    how: str = "stop"
    detail: str = ""
    restartable: bool = True
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

    def close(self) -> None:
        """Release what the host holds open (NVML holds /dev/nvidia* itself)."""
        ...
