"""A simulated PCI side with real holders: `sim:DIR` whose host.toml says
`real_holders = ["libvirt"]`.

This is how the libvirt integration is tested end to end on machines without
a GPU: tokens, drivers and switches come from the simulation, while holders
of the listed kinds are real (libvirt domains on a real libvirtd, units,
containers).  Holders of other kinds stay simulated.
"""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Mapping, Sequence
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
)
from charly_arbiter.core.model import Claimant, ProcessRef
from charly_arbiter.errors import HostError
from charly_arbiter.host.holders import HolderRegistry, SourceFactory, known_owner
from charly_arbiter.host.procscan import DeviceNumber
from charly_arbiter.host.sim import SimHost


def open_sim(config: Config, sources: Mapping[str, SourceFactory]) -> SimHost | HybridHost:
    """The simulated host named by `config.host`, with real holders where it says so
    (`sources` are the real holder kinds it may ask for)."""
    directory = Path(config.host.removeprefix("sim:"))
    sim = SimHost(directory, config.timeouts.driver_switch)
    kinds = real_holder_kinds(directory / "host.toml", sources)
    if not kinds:
        return sim
    return HybridHost(sim, HolderRegistry(config, {kind: sources[kind] for kind in kinds}))


def real_holder_kinds(path: Path, sources: Mapping[str, SourceFactory]) -> tuple[str, ...]:
    try:
        with path.open("rb") as handle:
            kinds = tomllib.load(handle).get("real_holders", [])
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise HostError(f"cannot read the simulated host {path}: {error}") from error
    if not isinstance(kinds, list) or any(kind not in sources for kind in kinds):
        raise HostError(f"{path}: real_holders must list kinds among {', '.join(sources)}")
    return tuple(str(kind) for kind in kinds)


class HybridHost:
    def __init__(self, sim: SimHost, real: HolderRegistry) -> None:
        self.sim = sim
        self.real = real
        self.description = f"{sim.description} with real {', '.join(real.kinds)} holders"

    def _is_real(self, ref: Claimant) -> bool:
        return Claimant.parse(ref).kind in self.real.kinds

    def boot_id(self) -> str:
        return self.sim.boot_id()

    def gpus(self) -> Sequence[PciFunction]:
        return self.sim.gpus()

    def token_functions(self, name: str, address: str) -> Sequence[PciFunction]:
        return self.sim.token_functions(name, address)

    def switch(self, token: TokenSpec, targets: Mapping[str, str]) -> None:
        self.sim.switch(token, targets)

    def write_vf_count(self, address: str, count: int) -> None:
        self.sim.write_vf_count(address, count)

    def mig(self, token: TokenSpec) -> MigState | None:
        return self.sim.mig(token)

    def set_mig(self, token: TokenSpec, change: MigChange) -> MigState:
        return self.sim.set_mig(token, change)

    def holders(self, tokens: Sequence[TokenSpec]) -> Sequence[Holder]:
        """The simulated holders, the real ones, and the real processes holding the
        simulated nodes that run in none of the real holders (a container's are its)."""
        found = self.managed_holders(tokens)
        return [*self.process_holders(tokens, {h.ref for h in found if h.running}), *found]

    def managed_holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        simulated = [h for h in self.sim.simulated_holders(tokens) if not self._is_real(h.ref)]
        return [*simulated, *self.real.holders(tokens)]

    def process_holders(
        self, tokens: Sequence[TokenSpec], running: Collection[Claimant]
    ) -> list[Holder]:
        return self.sim.node_holders(tokens, known_owner(self.real, self.sim.roots.proc, running))

    def device_users(self, tokens: Sequence[TokenSpec]) -> Sequence[DeviceUser]:
        return self.sim.device_users(tokens, known_owner(self.real, self.sim.roots.proc, None))

    def device_functions(self, numbers: Sequence[DeviceNumber]) -> dict[DeviceNumber, str]:
        return self.sim.device_functions(numbers)

    def is_running(self, ref: Claimant) -> bool:
        if self._is_real(ref):
            return self.real.for_ref(ref).is_running(ref)
        return self.sim.is_running(ref)

    def are_running(self, refs: Sequence[Claimant]) -> dict[Claimant, bool]:
        simulated = self.sim.are_running([ref for ref in refs if not self._is_real(ref)])
        return {ref: simulated[ref] if ref in simulated else self.is_running(ref) for ref in refs}

    def stop(self, ref: Claimant) -> None:
        if self._is_real(ref):
            self.real.for_ref(ref).stop(ref)
        else:
            self.sim.stop(ref)

    def start(self, ref: Claimant) -> None:
        if self._is_real(ref):
            self.real.for_ref(ref).start(ref)
        else:
            self.sim.start(ref)

    def tell(self, sessions: Sequence[Claimant], message: str) -> None:
        self.sim.tell(sessions, message)

    def screen(self, token: TokenSpec) -> ScreenUse:
        return self.sim.screen(token)

    def passthrough_blocker(self, token: TokenSpec) -> Blocker | None:
        return self.sim.passthrough_blocker(token)

    def current_process(self) -> ProcessRef:
        return self.sim.current_process()

    def process_alive(self, process: ProcessRef) -> bool:
        return self.sim.process_alive(process)

    def regenerate_cdi(self, token: TokenSpec) -> None:
        self.sim.regenerate_cdi(token)

    def inhibit(self, token: str, why: str) -> None:
        self.sim.inhibit(token, why)

    def uninhibit(self, token: str) -> None:
        self.sim.uninhibit(token)

    def inhibitors(self) -> Mapping[str, str]:
        return self.sim.inhibitors()

    def sleep_lock_unavailable(self) -> str | None:
        return self.sim.sleep_lock_unavailable()

    def close(self) -> None:
        self.real.close()
        self.sim.close()
