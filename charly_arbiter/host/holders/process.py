"""Processes that hold a GPU's device nodes open, found by scanning /proc.

Such a process is refused by default (the refusal names its pid, command and
node), or terminated when `device_holder_policy = "terminate"`: SIGTERM, then
SIGKILL after the holder stop timeout.  A terminated process cannot be
brought back, so these holders are not restartable.

What counts as holding an NVIDIA GPU (the driver's documented nodes, see
data/pci.toml): its own `/dev/nvidiaN`, and the driver-wide nodes
(`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`,
`nvidia-caps/*`) that every CUDA process opens.  A process holding only
driver-wide nodes holds every NVIDIA token, unless NVML's per-GPU process
lists place it on other GPUs and on none of the claimed ones; a process NVML
lists on a claimed GPU holds it whatever the scan saw.  (Conservative on
purpose: a process NVML lists nowhere may be between `cuInit` and its first
context, and an unbind under it would hang.)

`nvidia-persistenced` holds /dev/nvidiaN of every GPU in persistence mode on
purpose; it is not stopped for a claim but asked to let go of that one GPU
(`nvidia-persistence:ADDRESS`, see holders/nvidia.py), and its driver-wide
nodes do not make it a holder of anything.

A process that runs in a holder the host knows (a listed unit, a container,
found by its cgroup: `owner_of`) is that holder's, not a holder of its own:
stopping or draining the holder is what lets go of the node.

PID 1 and systemd-logind holding a DRM node (`/dev/dri/*`) are no holders either:
logind opens a session's card for its compositor (TakeDevice) and keeps the fd in
PID 1's fd store; both let go when the session ends.  That session is the screen's
(host/screen.py): refused naming it, or ended under `screen = "release"`.  Listed
here they would refuse every claim of a GPU a desktop draws on, the session's end
included (the real systemd guest's first release was refused by `process:1`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import DeviceUser, Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind, ProcessPolicy
from charly_arbiter.errors import HolderError
from charly_arbiter.host.holders.nvidia import persistence_ref
from charly_arbiter.host.pcidata import driver_nodes, function_nodes
from charly_arbiter.host.procscan import (
    DeviceNumber,
    alive,
    char_device_number,
    command_name,
    program_name,
    scan,
)
from charly_arbiter.host.sysfs import DEV_ROOT, PROC_ROOT, Sysfs

# A token's own device nodes now: node path -> the token's name.
NodeSource = Callable[[Sequence[TokenSpec]], dict[str, str]]
# The holder a process runs in (by its cgroup), where the host knows one.
OwnerOf = Callable[[int], Claimant | None]
# address -> the pids NVML lists with a context on that GPU; None where NVML is
# not usable (no driver, no library).
NvmlProcesses = Callable[[], Mapping[str, frozenset[int]] | None]
# pid -> token -> the nodes (or NVML contexts) by which it holds that token
Held = dict[int, dict[str, set[str]]]

log = logging.getLogger(__name__)

PERSISTENCED = "nvidia-persistenced"
NVIDIA = "nvidia"
_KILL_WAIT = 5.0
_POLL = 0.05


class ProcessHolders:
    kind = HolderKind.PROCESS

    def __init__(
        self,
        config: Config,
        sysfs: Sysfs | None = None,
        proc_root: Path = PROC_ROOT,
        dev_root: Path = DEV_ROOT,
        nodes: NodeSource | None = None,
        nvml_processes: NvmlProcesses = lambda: None,
    ) -> None:
        """`nodes` says which nodes each token has (default: from sysfs under `dev_root`;
        the simulated host lists its own)."""
        self.config = config
        self.sysfs = sysfs or Sysfs()
        self.proc_root = proc_root
        self.dev_root = dev_root
        self.nodes = nodes or self._sysfs_nodes
        # The driver's own nodes are this machine's /dev: not for a host that lists its own.
        self.driver_wide = nodes is None
        self.nvml_processes = nvml_processes

    def _sysfs_nodes(self, tokens: Sequence[TokenSpec]) -> dict[str, str]:
        node_token: dict[str, str] = {}
        for token in tokens:
            for function in token.functions:
                if not self.sysfs.exists(function.address):
                    continue
                fresh = self.sysfs.function(function.address)
                for node in function_nodes(self.sysfs, self.dev_root, self.proc_root, fresh):
                    node_token[node] = token.name
        return node_token

    def _driver_wide(self, tokens: Sequence[TokenSpec]) -> dict[str, set[str]]:
        """NVIDIA's driver-wide nodes -> the tokens with a function on nvidia now."""
        on_nvidia = [
            token.name for token in tokens if any(f.driver == NVIDIA for f in token.functions)
        ]
        if not on_nvidia or not self.driver_wide:
            return {}
        return {node: set(on_nvidia) for node in driver_nodes(self.dev_root, NVIDIA)}

    def _held(self, tokens: Sequence[TokenSpec]) -> Held:
        """Who holds which token, by which nodes: the scan (by path, or, as a container
        sees it, by device number), then what NVML says."""
        own = self.nodes(tokens)
        shared = self._driver_wide(tokens)
        numbers: dict[DeviceNumber, str] = {}
        for node in (*own, *shared):
            number = char_device_number(Path(node))
            if number is not None:
                numbers[number] = node
        held: Held = {}
        ours = {os.getpid()}
        for opened in scan(self.proc_root, {*own, *shared}, exclude=ours, numbers=numbers):
            names = {own[opened.node]} if opened.node in own else shared[opened.node]
            for name in names:
                held.setdefault(opened.pid, {}).setdefault(name, set()).add(opened.node)
        gpus = {  # token -> its functions' addresses that are on nvidia
            token.name: {f.address for f in token.functions if f.driver == NVIDIA}
            for token in tokens
        }
        nvml = self.nvml_processes() if any(gpus.values()) else None
        if nvml is not None:
            _apply_nvml(held, set(own), gpus, nvml, ours, self.proc_root)
        return held

    def users(
        self, tokens: Sequence[TokenSpec], owner_of: OwnerOf | None = None
    ) -> list[DeviceUser]:
        """Every process holding one of the tokens' nodes, with the holder it runs in."""
        return [
            DeviceUser(
                pid,
                command_name(self.proc_root, pid),
                node,
                token,
                owner_of(pid) if owner_of else None,
            )
            for pid, by_token in sorted(self._held(tokens).items())
            for token, nodes in sorted(by_token.items())
            for node in sorted(nodes)
        ]

    def holders(self, tokens: Sequence[TokenSpec], owner_of: OwnerOf | None = None) -> list[Holder]:
        """The processes holding the tokens' nodes that run in no holder `owner_of` knows."""
        own = set(self.nodes(tokens))
        gpus = {
            token.name: {f.address for f in token.functions if f.driver == NVIDIA}
            for token in tokens
        }
        found: list[Holder] = []
        for pid, by_token in sorted(self._held(tokens).items()):
            if owner_of is not None and owner_of(pid) is not None:
                continue
            if _brokers_a_session(self.proc_root, pid, by_token):
                continue
            if program_name(self.proc_root, pid) == PERSISTENCED:
                found.extend(_persistence(pid, by_token, own, gpus))
                continue
            nodes = ", ".join(sorted({node for n in by_token.values() for node in n}))
            comm = command_name(self.proc_root, pid)
            found.append(
                Holder(
                    ref=Claimant.of(HolderKind.PROCESS, str(pid)),
                    tokens=tuple(sorted(by_token)),
                    preemptible=self.config.process_policy == ProcessPolicy.TERMINATE,
                    running=True,
                    how=f"SIGTERM, SIGKILL after {self.config.timeouts.holder_stop:g} s",
                    detail=f"pid {pid} {comm} has {nodes} open",
                    restartable=False,
                )
            )
        return found

    def is_running(self, ref: Claimant) -> bool:
        return alive(self.proc_root, _pid(ref))

    def stop(self, ref: Claimant) -> None:
        """SIGTERM; SIGKILL when it is still there after the holder stop timeout."""
        pid = _pid(ref)
        if not self._signal(pid, signal.SIGTERM):
            return
        if self._gone_within(pid, self.config.timeouts.holder_stop):
            log.info("%s exited after SIGTERM", ref)
            return
        log.warning(
            "%s ignored SIGTERM for %g s; sending SIGKILL", ref, self.config.timeouts.holder_stop
        )
        self._signal(pid, signal.SIGKILL)
        if not self._gone_within(pid, _KILL_WAIT):
            raise HolderError(ref, "stop", f"it is still alive {_KILL_WAIT:g} s after SIGKILL")

    def start(self, ref: Claimant) -> None:
        log.info("%s was a process; there is nothing to start again", ref)

    def _signal(self, pid: int, signum: signal.Signals) -> bool:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        except PermissionError as error:
            raise HolderError(f"process:{pid}", "stop", str(error)) from None
        return True

    def _gone_within(self, pid: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while alive(self.proc_root, pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)
        return True


# Hold a logind session's DRM nodes on its behalf (TakeDevice; PID 1's fd store).
DEVICE_BROKERS = frozenset({"systemd-logind"})


def _brokers_a_session(proc_root: Path, pid: int, by_token: Mapping[str, set[str]]) -> bool:
    """Whether `pid` is PID 1 or logind holding only DRM nodes (see the module's note)."""
    nodes = {node for held in by_token.values() for node in held}
    if not nodes or not all(node.split("/")[-2:-1] == ["dri"] for node in nodes):
        return False
    return pid == 1 or program_name(proc_root, pid) in DEVICE_BROKERS


def _pid(ref: str) -> int:
    claimant = Claimant.parse(ref)
    if claimant.kind != HolderKind.PROCESS:
        raise HolderError(ref, "find", "not a process:PID holder")
    return int(claimant.name)  # a process claimant's name is digits (Claimant.parse)


def _apply_nvml(
    held: Held,
    own: set[str],
    gpus: Mapping[str, set[str]],
    nvml: Mapping[str, frozenset[int]],
    ours: set[int],
    proc_root: Path,
) -> None:
    """Drop the driver-wide holding of a process NVML places on other GPUs only, and
    add every process NVML lists on a claimed GPU (in place)."""
    where: dict[int, set[str]] = {}
    for address, pids in nvml.items():
        for pid in pids:
            where.setdefault(pid, set()).add(address)
    for pid, by_token in held.items():
        if pid not in where:
            continue
        for name in list(by_token):
            only_shared = all(node not in own for node in by_token[name])
            if only_shared and not where[pid] & gpus[name]:
                del by_token[name]
    for name, addresses in gpus.items():
        for address in sorted(addresses):
            for pid in sorted(nvml.get(address, ())):
                if pid not in ours and alive(proc_root, pid):
                    label = f"a context on {address} (NVML)"
                    held.setdefault(pid, {}).setdefault(name, set()).add(label)
    for pid in [pid for pid, by_token in held.items() if not by_token]:
        del held[pid]


def _persistence(
    pid: int, by_token: Mapping[str, set[str]], own: set[str], gpus: Mapping[str, set[str]]
) -> list[Holder]:
    """nvidia-persistenced as a holder of the GPUs whose own node it has open."""
    found = []
    for name, nodes in sorted(by_token.items()):
        if not any(node in own for node in nodes):
            continue  # its driver-wide nodes hold no GPU
        for address in sorted(gpus.get(name, ())):
            found.append(
                Holder(
                    ref=persistence_ref(address),
                    tokens=(name,),
                    preemptible=True,
                    running=True,
                    how="persistence mode off for this GPU (back on afterwards)",
                    detail=f"pid {pid} {PERSISTENCED} has {', '.join(sorted(nodes))} open",
                )
            )
    return found
