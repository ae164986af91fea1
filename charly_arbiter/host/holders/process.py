"""Processes that hold a GPU's device nodes open, found by scanning /proc.

Such a process is refused by default (the refusal names its pid, command and
node), or terminated when `device_holder_policy = "terminate"`: SIGTERM, then
SIGKILL after the holder stop timeout.  A terminated process cannot be
brought back, so these holders are not restartable.

`nvidia-persistenced` is the exception: it holds /dev/nvidia* on purpose, is
stopped for a claim and must come back afterwards, so it is reported as the
service `systemd:nvidia-persistenced.service` (stopped and started by the
systemd holder source) rather than as a process to kill.

A process that runs in a holder the host knows (a listed unit, a container,
found by its cgroup: `owner_of`) is that holder's, not a holder of its own:
stopping or draining the holder is what lets go of the node.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import DeviceUser, Holder, TokenSpec
from charly_arbiter.core.model import Claimant
from charly_arbiter.errors import HolderError
from charly_arbiter.host.pcidata import function_nodes
from charly_arbiter.host.procscan import (
    DeviceNumber,
    OpenNode,
    alive,
    char_device_number,
    program_name,
    scan,
)
from charly_arbiter.host.sysfs import DEV_ROOT, PROC_ROOT, Sysfs

# A token's device nodes now: node path -> the token's name.
NodeSource = Callable[[Sequence[TokenSpec]], dict[str, str]]
# The holder a process runs in (by its cgroup), where the host knows one.
OwnerOf = Callable[[int], Claimant | None]

log = logging.getLogger(__name__)

PERSISTENCED = "nvidia-persistenced"
PERSISTENCED_UNIT = Claimant.parse("systemd:nvidia-persistenced.service")
_KILL_WAIT = 5.0
_POLL = 0.05


class ProcessHolders:
    kind = "process"

    def __init__(
        self,
        config: Config,
        sysfs: Sysfs | None = None,
        proc_root: Path = PROC_ROOT,
        dev_root: Path = DEV_ROOT,
        nodes: NodeSource | None = None,
    ) -> None:
        """`nodes` says which nodes each token has (default: from sysfs under `dev_root`;
        the simulated host lists its own)."""
        self.config = config
        self.sysfs = sysfs or Sysfs()
        self.proc_root = proc_root
        self.dev_root = dev_root
        self.nodes = nodes or self._sysfs_nodes

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

    def open_nodes(self, tokens: Sequence[TokenSpec]) -> dict[str, list[OpenNode]]:
        """token name -> every (pid, command, node) holding one of its nodes (by its
        path, or, as a container sees it, by its device number)."""
        node_token = self.nodes(tokens)
        numbers: dict[DeviceNumber, str] = {}
        for node in node_token:
            number = char_device_number(Path(node))
            if number is not None:
                numbers[number] = node
        by_token: dict[str, list[OpenNode]] = {}
        for found in scan(self.proc_root, node_token, exclude={os.getpid()}, numbers=numbers):
            by_token.setdefault(node_token[found.node], []).append(found)
        return by_token

    def users(
        self, tokens: Sequence[TokenSpec], owner_of: OwnerOf | None = None
    ) -> list[DeviceUser]:
        """Every process holding one of the tokens' nodes, with the holder it runs in."""
        return [
            DeviceUser(
                item.pid, item.comm, item.node, token, owner_of(item.pid) if owner_of else None
            )
            for token, opened in sorted(self.open_nodes(tokens).items())
            for item in opened
        ]

    def holders(self, tokens: Sequence[TokenSpec], owner_of: OwnerOf | None = None) -> list[Holder]:
        """The processes holding the tokens' nodes that run in no holder `owner_of` knows."""
        pids: dict[int, list[tuple[str, OpenNode]]] = {}
        for token, opened in self.open_nodes(tokens).items():
            for item in opened:
                pids.setdefault(item.pid, []).append((token, item))
        terminate = self.config.process_policy == "terminate"
        stop_wait = self.config.timeouts.holder_stop
        found: list[Holder] = []
        for pid, items in sorted(pids.items()):
            if owner_of is not None and owner_of(pid) is not None:
                continue
            held = tuple(dict.fromkeys(token for token, _ in items))
            nodes = ", ".join(sorted({item.node for _, item in items}))
            comm = items[0][1].comm
            if program_name(self.proc_root, pid) == PERSISTENCED:
                found.append(
                    Holder(
                        ref=PERSISTENCED_UNIT,
                        tokens=held,
                        preemptible=True,
                        running=True,
                        how="systemctl stop (restarted afterwards)",
                        detail=f"pid {pid} has {nodes} open",
                    )
                )
                continue
            found.append(
                Holder(
                    ref=Claimant.of("process", str(pid)),
                    tokens=held,
                    preemptible=terminate,
                    running=True,
                    how=f"SIGTERM, SIGKILL after {stop_wait:g} s",
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


def _pid(ref: str) -> int:
    claimant = Claimant.parse(ref)
    if claimant.kind != "process":
        raise HolderError(ref, "find", "not a process:PID holder")
    return int(claimant.name)  # a process claimant's name is digits (Claimant.parse)
