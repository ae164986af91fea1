"""A simulated PCI side with real holders: `sim:DIR` whose host.toml says
`real_holders = ["libvirt"]`.

This is how the libvirt integration is tested end to end on machines without
a GPU: tokens, drivers and switches come from the simulation, while holders
of the listed kinds are real (libvirt domains on a real libvirtd, units,
containers).  Holders of other kinds stay simulated.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import (
    Blocker,
    DeviceUser,
    Holder,
    Host,
    MigChange,
    MigState,
    PciFunction,
    TokenSpec,
)
from charly_arbiter.core.model import Claimant, ProcessRef
from charly_arbiter.errors import HostError
from charly_arbiter.host.draining import Drains, token_specs
from charly_arbiter.host.holders import HolderRegistry, SourceFactory, known_owner
from charly_arbiter.host.procscan import DeviceNumber
from charly_arbiter.host.sim import PROC_ROOT, SimHost


def open_sim(config: Config, sources: Mapping[str, SourceFactory]) -> Host:
    """The simulated host named by `config.host`, with real holders where it says so
    (`sources` are the real holder kinds it may ask for)."""
    directory = Path(config.host.removeprefix("sim:"))
    sim = SimHost(directory, config.timeouts.driver_switch)
    kinds = real_holder_kinds(directory / "host.toml", sources)
    if not kinds:
        sim.drains = Drains(
            config, token_specs(config, sim.token_functions), sim.device_users, sim.boot_id
        )
        return sim
    return HybridHost(sim, HolderRegistry(config, {kind: sources[kind] for kind in kinds}), config)


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
    def __init__(self, sim: SimHost, real: HolderRegistry, config: Config | None = None) -> None:
        self.sim = sim
        self.real = real
        self.description = f"{sim.description} with real {', '.join(real.kinds)} holders"
        self.drains = Drains(
            config or real.config,
            token_specs(config or real.config, sim.token_functions),
            self.device_users,
            sim.boot_id,
        )

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
        simulated = [h for h in self.sim.simulated_holders(tokens) if not self._is_real(h.ref)]
        found = self.drains.holders([*simulated, *self.real.holders(tokens)])
        running = {holder.ref for holder in found if holder.running}
        processes = self.sim.process_holders(tokens, known_owner(self.real, PROC_ROOT, running))
        return [*processes, *found]

    def device_users(self, tokens: Sequence[TokenSpec]) -> Sequence[DeviceUser]:
        return self.sim.device_users(tokens, known_owner(self.real, PROC_ROOT, None))

    def device_functions(self, numbers: Sequence[DeviceNumber]) -> dict[DeviceNumber, str]:
        return self.sim.device_functions(numbers)

    def is_running(self, ref: Claimant) -> bool:
        if self._is_real(ref):
            return self.drains.is_running(ref, self.real.for_ref(ref).is_running(ref))
        return self.drains.is_running(ref, self.sim.is_running(ref))

    def are_running(self, refs: Sequence[Claimant]) -> dict[Claimant, bool]:
        simulated = self.sim.are_running([ref for ref in refs if not self._is_real(ref)])
        return {
            ref: self.drains.is_running(ref, simulated[ref])
            if ref in simulated
            else self.is_running(ref)
            for ref in refs
        }

    def stop(self, ref: Claimant) -> None:
        if self._is_real(ref):
            self.drains.stop(ref, lambda: self.real.for_ref(ref).stop(ref))
        else:
            self.drains.stop(ref, lambda: self.sim.stop(ref))

    def start(self, ref: Claimant) -> None:
        if self._is_real(ref):
            source = self.real.for_ref(ref)
            self.drains.start(ref, lambda: source.start(ref), lambda: source.is_running(ref))
        else:
            self.drains.start(ref, lambda: self.sim.start(ref), lambda: self.sim.is_running(ref))

    def passthrough_blocker(self, token: TokenSpec) -> Blocker | None:
        return self.sim.passthrough_blocker(token)

    def current_process(self) -> ProcessRef:
        return self.sim.current_process()

    def process_alive(self, process: ProcessRef) -> bool:
        return self.sim.process_alive(process)

    def regenerate_cdi(self, token: TokenSpec) -> None:
        self.sim.regenerate_cdi(token)

    def close(self) -> None:
        self.real.close()
        self.sim.close()
