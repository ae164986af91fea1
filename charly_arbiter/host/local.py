"""`local`: the real machine, through sysfs, /proc and the holder sources.

PCI functions and driver switching go through `sysfs.Sysfs`/`Switcher`,
device-holding processes through `holders.process`, and every other holder
kind (systemd units, containers, libvirt domains) through the
`HolderRegistry`, which builds each source only when a ref of its kind comes
up.  The /sys, /proc and /dev roots are constructor parameters, so the same
code runs against a fake tree in tests and the real one in a VM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import (
    Blocker,
    DeviceUser,
    Holder,
    MigChange,
    MigState,
    PciFunction,
    ScreenUse,
    TokenSpec,
    common_blocker,
    vgpu_type_of,
)
from charly_arbiter.core.model import (
    SCREEN_KINDS,
    VFIO,
    Claimant,
    ConsolePolicy,
    ProcessRef,
    target_label,
)
from charly_arbiter.errors import (
    CommandFailed,
    HostError,
    MigFailed,
    SwitchFailed,
    SwitchHung,
    VfCountFailed,
    VfCountHung,
    cli_command,
)
from charly_arbiter.host import run
from charly_arbiter.host.blocking import TimedOut, Writer, bounded, errno_text
from charly_arbiter.host.console import Console
from charly_arbiter.host.devnodes import device_functions
from charly_arbiter.host.holders import HolderRegistry, HolderSource, SourceFactory, known_owner
from charly_arbiter.host.holders.desktop import DesktopHolders
from charly_arbiter.host.holders.nvidia import NvidiaPersistence
from charly_arbiter.host.holders.process import ProcessHolders
from charly_arbiter.host.inhibit import SleepLocks
from charly_arbiter.host.kmod import MODULES_ROOT, KernelModules
from charly_arbiter.host.nvml import Nvml
from charly_arbiter.host.pcidata import pci_data
from charly_arbiter.host.procscan import DeviceNumber, process_alive, process_ref
from charly_arbiter.host.screen import ScreenReader
from charly_arbiter.host.sysfs import HOST_ROOTS, SYS_ROOT, Roots, Switcher, Sysfs
from charly_arbiter.host.sysfs import write_attribute as default_writer

log = logging.getLogger(__name__)

CDI_SPEC = Path("/etc/cdi/nvidia.yaml")
NVIDIA_VENDOR = "10de"


class LocalPci:
    """This machine's PCI functions and IOMMU groups, as sysfs shows them: all the
    token catalogue asks (core/tokens.PciSource), without the holders, NVML or the
    switch that the whole host brings (compose.token_catalogue)."""

    def __init__(
        self,
        roots: Roots = HOST_ROOTS,
        writer: Writer = default_writer,
        modules_root: Path = MODULES_ROOT,
    ) -> None:
        self.sysfs = Sysfs(roots.sys, writer)
        self.modules = KernelModules(modules_root, _release(roots.proc))

    def functions(self) -> list[PciFunction]:
        return [self.sysfs.function(address) for address in self.sysfs.addresses()]

    def gpus(self) -> list[PciFunction]:
        return [function for function in self.functions() if function.is_display]

    def token_functions(self, name: str, address: str) -> list[PciFunction]:
        if not self.sysfs.exists(address):
            raise HostError(
                f"token {name}: there is no PCI device {address} on this host",
                hint=f"check the token's address in arbiter.toml against {cli_command('detect')}",
            )
        return [self._with_default_driver(f) for f in self.sysfs.group_functions(address)]

    def _with_default_driver(self, function: PciFunction) -> PciFunction:
        """A function on vfio-pci or on no driver learns where the kernel would send it
        home (the others are home already, or tell by their driver).  A virtual function
        whose PF has `sriov_drivers_autoprobe` off has none: the kernel binds no driver
        to it by itself (seen on Linux 6.1), and an operator who turned it off keeps the
        VFs for VMs, so its home is no driver, not the PF's driver."""
        if function.driver not in (None, VFIO):
            return function
        if (
            function.physfn is not None
            and self.sysfs.attribute(function.physfn, "sriov_drivers_autoprobe") == "0"
        ):
            return function
        matching = self.modules.matching(self.sysfs.modalias(function.address))
        modules = [module for module in matching if self.modules.has(module)]
        return replace(function, default_driver=pci_data().default_driver(function.vendor, modules))


class LocalHost:
    def __init__(
        self,
        config: Config,
        *,
        roots: Roots = HOST_ROOTS,
        writer: Writer = default_writer,
        cdi_spec: Path = CDI_SPEC,
        modules_root: Path = MODULES_ROOT,
        sources: Mapping[str, SourceFactory] | None = None,
        isolate_writes: bool = True,
        load_module: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.roots = roots
        self.pci = LocalPci(roots, writer, modules_root)
        self.modules = self.pci.modules
        self.description = "local" if roots.sys == SYS_ROOT else f"local (sysfs at {roots.sys})"
        self.sysfs = self.pci.sysfs
        self.proc_root = roots.proc
        self.dev_root = roots.dev
        self.cdi_spec = cdi_spec
        self.switcher = Switcher(
            self.sysfs,
            roots.dev,
            config.timeouts.driver_switch,
            load_module=load_module or (lambda driver: _modprobe(pci_data().module_of(driver))),
            isolate=isolate_writes,
        )
        self.console = Console(
            self.sysfs,
            roots.proc,
            roots.dev,
            self.switcher.blocking_writer,
            config.timeouts.driver_switch,
        )
        self.screens = ScreenReader(self.sysfs, roots, self.console)
        self.nvml = Nvml()
        self.mig_error = ""  # why `mig` said None last
        self.sleep_locks = SleepLocks(
            roots.run, config.timeouts.holder_start, config.timeouts.holder_stop
        )
        self.processes = ProcessHolders(
            config, self.sysfs, roots.proc, roots.dev, nvml_processes=self._nvml_processes
        )
        self.persistence = NvidiaPersistence(config)
        self.desktop = DesktopHolders(config, roots)  # a screen's, when it is released
        # Processes (and the NVIDIA daemon's hold on a GPU) are this host's own; every
        # other kind comes from `sources`.
        own = (ProcessHolders.kind, NvidiaPersistence.kind)
        others = {k: f for k, f in (sources or {}).items() if k not in own}
        self.registry = HolderRegistry(config, others)

    def boot_id(self) -> str:
        path = self.proc_root / "sys" / "kernel" / "random" / "boot_id"
        try:
            return path.read_text().strip()
        except OSError as error:
            raise HostError(f"cannot read the boot id from {path}: {error.strerror}") from None

    def functions(self) -> list[PciFunction]:
        return self.pci.functions()

    def gpus(self) -> list[PciFunction]:
        return self.pci.gpus()

    def token_functions(self, name: str, address: str) -> list[PciFunction]:
        return self.pci.token_functions(name, address)

    def switch(self, token: TokenSpec, targets: Mapping[str, str]) -> None:
        known = {function.address for function in token.functions}
        for address in targets:
            if address not in known:
                raise SwitchFailed(
                    address,
                    target_label(targets[address]),
                    "plan",
                    f"it is not a function of {token.name}",
                )
        self.nvml.close()  # an open NVML session holds /dev/nvidia* itself
        targets = self._vgpu_types(targets)
        leaving = any(driver == VFIO for driver in targets.values())
        if leaving and token.console == ConsolePolicy.RELEASE:
            self.console.release(token)
        self.switcher.switch(targets)
        if not leaving and token.console == ConsolePolicy.RELEASE:
            self.console.restore(token)
        self._check_health(targets)

    def _vgpu_types(self, targets: Mapping[str, str]) -> dict[str, str]:
        """Give each NVIDIA vGPU VF its type (`vgpu:ID`), or clear it (0) where the VF goes
        home, before anything else; what is left is the drivers' switch.  The writes are
        the write helper's, under the watchdog, as unbind's are."""
        drivers: dict[str, str] = {}
        for address, target in sorted(targets.items()):
            wanted = vgpu_type_of(target)
            vgpu = self.sysfs.vgpu(address)
            if wanted is None and (vgpu is None or not vgpu.current):
                drivers[address] = target
                continue
            driver = self.sysfs.current_driver(address)
            if wanted is not None and driver != "nvidia":
                raise SwitchFailed(
                    address, target, "check driver", f"a vGPU VF is on nvidia, not on {driver}"
                )
            self._write_vgpu_type(address, target, wanted or 0)
            if wanted is None:
                drivers[address] = target
        return drivers

    def _write_vgpu_type(self, address: str, target: str, type_id: int) -> None:
        if address in self.switcher.hung:
            raise SwitchFailed(
                address, target, "current_vgpu_type", "an earlier write never returned"
            )
        path = self.sysfs.device(address) / "nvidia" / "current_vgpu_type"
        writer = self.switcher.blocking_writer
        timeout = self.config.timeouts.driver_switch
        try:
            bounded(lambda: writer(path, str(type_id)), timeout, f"sysfs {address} vgpu")
        except TimedOut:
            self.switcher.hung[address] = "current_vgpu_type"
            raise SwitchHung(address, target_label(target), "current_vgpu_type", timeout) from None
        except OSError as error:
            raise SwitchFailed(address, target, "current_vgpu_type", errno_text(error)) from None
        now = self.sysfs.vgpu(address)
        if now is None or now.current != type_id:
            raise SwitchFailed(
                address,
                target,
                "verify",
                f"current_vgpu_type reads {now.current if now else 'nothing'}, not {type_id}",
            )

    def _check_health(self, targets: Mapping[str, str]) -> None:
        """After a switch home: does the device answer, and does its driver see it?

        A GPU that fell off the bus (a reset it does not survive) reads all ones;
        the nvidia driver can bind a GPU it then fails to initialise, which NVML
        shows by not listing it.  Either is a failed switch: the token is poisoned
        with what to try.  A virtual function's vendor id reads 0xffff by the SR-IOV
        specification (seen on the real kernel, tests/kernel/test_sriov_kernel.py):
        whether it answers shows on its physical function.
        """
        home = {address: driver for address, driver in targets.items() if driver != VFIO}
        for address, driver in sorted(home.items()):
            physfn = self.sysfs.physfn(address)
            if self.sysfs.config_vendor(physfn or address) == 0xFFFF:
                whose = f"its physical function {physfn}'s" if physfn else "its"
                raise SwitchFailed(
                    address,
                    target_label(driver),
                    "health check",
                    f"{whose} configuration space reads 0xffff: the device does not answer; "
                    f"try a reset (`echo 1 > {self.sysfs.device(physfn or address)}/reset`), "
                    "else power the host off and on",
                )
        # (a virtual function is no GPU of NVML's: an NVIDIA vGPU VF is not listed)
        on_nvidia = [
            address
            for address, driver in home.items()
            if driver == "nvidia" and self.sysfs.physfn(address) is None
        ]
        if on_nvidia:
            seen = self.nvml.gpus()
            usable = self.nvml.error is None
            self.nvml.close()
            for address in on_nvidia:
                if usable and address not in seen:
                    raise SwitchFailed(
                        address,
                        "nvidia",
                        "health check",
                        "nvidia is bound but NVML does not list the GPU (see `dmesg` for NVRM "
                        "errors); try `nvidia-smi -r -i` on it, else reboot the host",
                    )

    def screen(self, token: TokenSpec) -> ScreenUse:
        return self.screens.of(token)

    def passthrough_blocker(self, token: TokenSpec) -> Blocker | None:
        blocker = common_blocker(token)
        if blocker is None and not self._vfio_available():
            blocker = Blocker(
                "vfio-pci is neither loaded nor installed for this kernel",
                "install the kernel's modules package (vfio-pci is part of it) "
                "and check `modprobe vfio-pci`",
            )
        if blocker is None and token.console == ConsolePolicy.REFUSE:
            display = self.console.of(token, servers=True)
            if display.drives_it:
                blocker = Blocker(
                    f"it drives the host's display: {display.describe()}",
                    "stop what draws on it (list the display manager as a preemptible holder), "
                    f'or set `console = "release"` for {token.name} in arbiter.toml to let the '
                    "arbiter take the console off it and give it back afterwards",
                )
        return blocker

    def write_vf_count(self, address: str, count: int) -> None:
        """By the write helper, under the watchdog, as unbind is: a teardown whose VF's
        VFIO device is held blocks in the kernel (vfio_unregister_group_dev) until the
        holder lets go, and nothing can end the writer meanwhile."""
        if address in self.switcher.hung:
            raise VfCountFailed(address, count, "an earlier write to this device never returned")
        path = self.sysfs.device(address) / "sriov_numvfs"
        writer = self.switcher.blocking_writer
        timeout = self.config.timeouts.driver_switch
        try:
            bounded(lambda: writer(path, str(count)), timeout, f"sysfs {address} sriov_numvfs")
        except TimedOut:
            self.switcher.hung[address] = "sriov_numvfs"
            raise VfCountHung(address, count, timeout) from None
        except OSError as error:
            raise VfCountFailed(address, count, errno_text(error)) from None

    def mig(self, token: TokenSpec) -> MigState | None:
        if not any(f.vendor == NVIDIA_VENDOR for f in token.functions):
            self.mig_error = "it is no NVIDIA GPU"
            return None
        try:
            state = self.nvml.mig(token.address)
            self.mig_error = self.nvml.error or ""
            return state
        finally:
            self.nvml.close()

    def set_mig(self, token: TokenSpec, change: MigChange) -> MigState:
        """Under a watchdog: an NVML call that never returns (a GPU that fell off the bus)
        must not keep the holders the change stopped down for good."""
        timeout = self.config.timeouts.driver_switch
        try:
            return bounded(lambda: self.nvml.set_mig(token.address, change), timeout, "mig")
        except TimedOut:
            raise MigFailed(
                token.address, str(change), f"NVML did not return within {timeout:g} s"
            ) from None
        finally:
            self.nvml.close()  # it holds /dev/nvidia*, which the holders coming back need

    def _vfio_available(self) -> bool:
        """Loaded, built in, or listed among this kernel's modules (modprobe loads it)."""
        if self.sysfs.driver(VFIO).is_dir() or (self.sysfs.root / "module" / "vfio_pci").is_dir():
            return True
        return self.modules.has("vfio_pci")

    def current_process(self) -> ProcessRef:
        return process_ref(self.proc_root, os.getpid()) or ProcessRef(os.getpid())

    def process_alive(self, process: ProcessRef) -> bool:
        return process_alive(self.proc_root, process)

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        """Every holder kind, then the processes holding the tokens' device nodes
        that run in none of the running holders found (a unit's or a container's
        processes are that holder's: stopping it is what lets go of the node)."""
        found = self.managed_holders(tokens)
        return [*self.process_holders(tokens, {h.ref for h in found if h.running}), *found]

    def managed_holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        """Every holder kind's holders but the device-node processes.

        A kind whose manager cannot be reached (libvirtd not running) has no
        holders to report: a VM that still runs without it holds /dev/vfio/N,
        which the process scan sees.  That is logged, not fatal.
        """
        found: list[Holder] = []
        for kind in self.registry.kinds:
            try:
                source = self.registry.source(kind)
                if source is not None:
                    found.extend(source.holders(tokens))
            except (HostError, ImportError) as error:
                log.warning("cannot list %s holders: %s", kind, error)
        return found

    def process_holders(
        self, tokens: Sequence[TokenSpec], running: Collection[Claimant]
    ) -> list[Holder]:
        return self.processes.holders(tokens, known_owner(self.registry, self.proc_root, running))

    def device_users(self, tokens: Sequence[TokenSpec]) -> list[DeviceUser]:
        return self.processes.users(tokens, known_owner(self.registry, self.proc_root, None))

    def device_functions(self, numbers: Sequence[DeviceNumber]) -> dict[DeviceNumber, str]:
        return device_functions(self.sysfs.root, self.proc_root, numbers)

    def source(self, ref: Claimant) -> HolderSource:
        kind = Claimant.parse(ref).kind
        if kind == ProcessHolders.kind:
            return self.processes
        if kind == NvidiaPersistence.kind:
            return self.persistence
        if kind in SCREEN_KINDS:
            return self.desktop
        return self.registry.for_ref(ref)

    def _nvml_processes(self) -> dict[str, frozenset[int]] | None:
        """Who has a context on each NVIDIA GPU, as NVML says (None: NVML unusable)."""
        gpus = self.nvml.gpus()
        if self.nvml.error is not None:
            return None
        return {address: frozenset(p.pid for p in gpu.processes) for address, gpu in gpus.items()}

    def is_running(self, ref: Claimant) -> bool:
        return self.source(ref).is_running(ref)

    def are_running(self, refs: Sequence[Claimant]) -> dict[Claimant, bool]:
        return {ref: self.is_running(ref) for ref in refs}

    def stop(self, ref: Claimant) -> None:
        self.source(ref).stop(ref)

    def start(self, ref: Claimant) -> None:
        self.source(ref).start(ref)

    def tell(self, sessions: Sequence[Claimant], message: str) -> None:
        self.desktop.tell(sessions, message)

    def regenerate_cdi(self, token: TokenSpec) -> None:
        """`nvidia-ctk cdi generate` after an NVIDIA GPU moved, either way: it lists
        the GPUs NVML sees on `nvidia`, so one that left for vfio-pci drops out."""
        if not any(function.vendor == NVIDIA_VENDOR for function in token.functions):
            return
        tool = run.which("nvidia-ctk")
        if tool is None:
            log.info("%s: nvidia-ctk is not installed; no CDI spec to regenerate", token.name)
            return
        run.run([tool, "cdi", "generate", f"--output={self.cdi_spec}"], timeout=120)
        log.info("%s: regenerated %s", token.name, self.cdi_spec)

    def inhibit(self, token: str, why: str) -> None:
        self.sleep_locks.inhibit(token, why)

    def uninhibit(self, token: str) -> None:
        self.sleep_locks.uninhibit(token)

    def inhibitors(self) -> dict[str, str]:
        return self.sleep_locks.inhibitors()

    def sleep_lock_unavailable(self) -> str | None:
        return self.sleep_locks.unavailable()

    def close(self) -> None:
        self.nvml.close()
        self.switcher.close()
        self.registry.close()


def _release(proc_root: Path) -> str:
    """The running kernel's release, as the /proc root says (a test tree has its own)."""
    try:
        return (proc_root / "sys" / "kernel" / "osrelease").read_text().strip()
    except OSError:
        return os.uname().release


def _modprobe(module: str) -> None:
    """Load a driver the way libvirt does before binding to it; the caller verifies."""
    tool = run.which("modprobe")
    if tool is None:
        log.warning("modprobe is not installed; cannot load %s", module)
        return
    try:
        run.run([tool, "--", module], timeout=60)
    except CommandFailed as error:
        log.warning("could not load %s: %s", module, error)
