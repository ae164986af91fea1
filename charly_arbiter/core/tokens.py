"""The tokens of this host, read once per command.

A token is a GPU with every function of its IOMMU group: configured by name in
arbiter.toml, or, without any, one per IOMMU group that holds a GPU, named
after the group's first GPU.  An SR-IOV virtual function is a token only when
configured (by its address): VFs come and go with their physical function's
count, and which of them go to VMs is the operator's choice; unconfigured, a
display-class VF would pass for a GPU of its own, and its physical function's
token already knows it.  Reading one means reading its group's functions and
their drivers from the host, so the catalogue does it once and hands the same
specs to everyone in the command (the hook's claim lookup, the claim itself,
status).  `reread` is for the moments drivers may have moved since (a claim
that waited).

Tokens never overlap: one function, one group, one owner.  Configured tokens
that share a function or an IOMMU group (the same address under two names, a
GPU and its own audio function, two GPUs behind a bridge without ACS) are a
configuration error, refused before anything acts on them.  Without a
configuration, two GPUs in one group are one token, since they can only leave
the host together; `merged` says which (doctor shows it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from charly_arbiter.core.config import DEFAULT_CONFIG, Config
from charly_arbiter.core.host import MigState, PciFunction, TokenSpec
from charly_arbiter.core.model import ConsolePolicy, Mode, ScreenPolicy
from charly_arbiter.errors import HostError, MigInvalid, TokensOverlap, UnknownToken, cli_command


def overlap(specs: Iterable[TokenSpec]) -> tuple[str, str, str] | None:
    """The first two tokens that share a function or an IOMMU group, and what they
    share ("0000:0a:00.1 (IOMMU group 12)"), or None."""
    by_address: dict[str, str] = {}
    by_group: dict[str, str] = {}
    for spec in specs:
        groups = {f.address: f.iommu_group for f in spec.functions}
        for address in sorted({spec.address, *groups}):
            other = by_address.get(address)
            if other is not None and other != spec.name:
                group = groups.get(address)
                return other, spec.name, address + (f" (IOMMU group {group})" if group else "")
        for group in sorted({g for g in groups.values() if g is not None}):
            other = by_group.get(group)
            if other is not None and other != spec.name:
                return other, spec.name, f"IOMMU group {group}"
        for address in {spec.address, *groups}:
            by_address.setdefault(address, spec.name)
        for group in groups.values():
            if group is not None:
                by_group.setdefault(group, spec.name)
    return None


def check_overlap(specs: Iterable[TokenSpec], config_path: Path) -> None:
    """Refuse (`TokensOverlap`, exit 2) tokens that share a function or a group."""
    found = overlap(specs)
    if found is not None:
        raise TokensOverlap(config_path, *found)


class PciSource(Protocol):
    """All the catalogue asks of a host: its GPUs, and a token's IOMMU group.  A Host
    is one; so is the PCI side alone (host/local.LocalPci, a simulated host), which
    is how a hook maps a domain's addresses to tokens without the whole host."""

    def gpus(self) -> Sequence[PciFunction]: ...

    def token_functions(self, name: str, address: str) -> Sequence[PciFunction]: ...


def _with_physical_functions(
    specs: dict[str, TokenSpec], missing: Mapping[str, HostError]
) -> dict[str, TokenSpec]:
    """Each configured token that sits where a configured physical function puts a
    virtual function learns that PF's address (`vf_of`), whether the VF exists now or
    not: the count may be 0, or a teardown stuck half-way may have taken its `physfn`
    link.  A configured address that is no device and no such VF is an error, as before.
    """
    places = {
        vf: function.address
        for spec in specs.values()
        for function in spec.functions
        if function.sriov is not None
        for vf in function.sriov.possible(function.address)
    }
    for name, spec in list(specs.items()):
        if name in missing and spec.address not in places:
            raise missing[name]
        if spec.address in places:
            specs[name] = replace(spec, vf_of=places[spec.address])
    return specs


def console_policy(console: ConsolePolicy, screen: ScreenPolicy) -> ConsolePolicy:
    """A token's console policy: `screen = "release"` releases the console too (a
    screen given up for a VM takes its console with it)."""
    return ConsolePolicy.RELEASE if screen is ScreenPolicy.RELEASE else console


class TokenCatalogue:
    def __init__(self, config: Config, host: PciSource) -> None:
        self.config = config
        self.host = host
        self._specs: dict[str, TokenSpec] | None = None
        # Without a configuration: each GPU that shares its group with an earlier
        # one -> the token (named after that one) it is part of.
        self.merged: dict[str, str] = {}

    def all(self) -> dict[str, TokenSpec]:
        """Every token, with each function's driver as read the first time.

        Raises `TokensOverlap` when configured tokens overlap: nothing may act on
        a configuration in which one GPU has two owners."""
        if self._specs is None:
            specs: dict[str, TokenSpec] = {}
            merged: dict[str, str] = {}
            if self.config.tokens:
                missing: dict[str, HostError] = {}
                for token in self.config.tokens:
                    try:
                        functions = tuple(self.host.token_functions(token.name, token.address))
                    except HostError as error:
                        functions, missing[token.name] = (), error
                    screen = token.screen or self.config.screen
                    specs[token.name] = TokenSpec(
                        token.name,
                        token.address,
                        functions,
                        token.home_driver,
                        token.cdi,
                        console_policy(token.console or self.config.console, screen),
                        screen=screen,
                        vgpu_type=token.vgpu_type,
                    )
                specs = _with_physical_functions(specs, missing)
            else:
                for gpu in self.host.gpus():
                    if gpu.is_virtual:
                        continue
                    part_of = next(
                        (
                            spec.name
                            for spec in specs.values()
                            if any(f.address == gpu.address for f in spec.functions)
                        ),
                        None,
                    )
                    if part_of is not None:
                        merged[gpu.address] = part_of
                        continue
                    functions = tuple(self.host.token_functions(gpu.address, gpu.address))
                    specs[gpu.address] = TokenSpec(
                        gpu.address,
                        gpu.address,
                        functions,
                        console=console_policy(self.config.console, self.config.screen),
                        screen=self.config.screen,
                    )
            check_overlap(specs.values(), self.config.path or DEFAULT_CONFIG)
            self._specs = specs
            self.merged = merged
        return self._specs

    def addresses(self) -> dict[str, frozenset[str]]:
        """token -> the addresses of its functions: what the planner checks a claim
        against, so that no function is claimed under two names."""
        return {name: _addresses(spec) for name, spec in self.all().items()}

    def refresh(self) -> None:
        """Forget what was read: the next question reads the host again (a long-lived
        process asks for status more than once)."""
        self._specs = None

    def resolve(self, names: Sequence[str]) -> list[TokenSpec]:
        """The named tokens (each once, in order), or `UnknownToken` naming the known ones."""
        known = self.all()
        missing = [name for name in names if name not in known]
        if missing:
            raise UnknownToken(missing[0], sorted(known))
        return [known[name] for name in dict.fromkeys(names)]

    def parent_names(
        self, names: Sequence[str], mode: Mode, mig: Callable[[TokenSpec], MigState | None]
    ) -> list[str]:
        """The names with each MIG sub-token (`TOKEN:N`, the MIG instance N of TOKEN's
        GPU) as its GPU's token, once the GPU has that instance now (`mig`, the host's
        reading of a GPU's MIG state: the catalogue's PCI side alone has none): a
        container using an instance uses the GPU, on its driver, beside the others
        (shared only)."""
        found = []
        known = self.all()
        for name in names:
            # (a token named after its address, without a configuration, has colons too)
            parent, colon, index = name.rpartition(":")
            if name in known or not colon or not index.isdigit() or parent not in known:
                found.append(name)
                continue
            [spec] = self.resolve([parent])
            if mode is not Mode.SHARED:
                raise MigInvalid(name, "a MIG instance is claimed shared (it is a use of the GPU)")
            state = mig(spec)
            if state is None or state.instance(int(index)) is None:
                have = (
                    ", ".join(f"{parent}:{i.index} ({i.profile})" for i in state.instances)
                    if state
                    else ""
                )
                raise MigInvalid(
                    name,
                    f"{parent} has no MIG instance {index}"
                    + (f" (it has {have})" if have else " (MIG is off, or NVML cannot say)"),
                    hint=f"run {cli_command('mig', operands=[parent])} to see its instances",
                )
            found.append(parent)
        return list(dict.fromkeys(found))

    def reread(self, names: Sequence[str]) -> list[TokenSpec]:
        """Like `resolve`, with each function's driver read again now."""
        return [
            replace(spec, functions=tuple(self.functions_now(spec))) for spec in self.resolve(names)
        ]

    def known(self, names: Sequence[str]) -> list[TokenSpec]:
        """The named tokens that still exist (a release may outlive a token's configuration)."""
        known = self.all()
        return [known[name] for name in names if name in known]

    def token_for_address(self, address: str) -> str | None:
        """The token one of whose functions is `address` (for claims read from XML)."""
        for spec in self.all().values():
            if any(function.address == address for function in spec.functions):
                return spec.name
        return None

    def parents(self) -> dict[str, str]:
        """token -> the token of its physical function, for the tokens on virtual
        functions whose PF is a token too: what the planner needs to treat a leased VF
        as a use of its PF."""
        found = {}
        for name, spec in self.all().items():
            pf = spec.physical_function
            owner = next(
                (o.name for o in self.all().values() if o.name != name and pf in _addresses(o)),
                None,
            )
            if pf is not None and owner is not None:
                found[name] = owner
        return found

    def functions_now(self, token: TokenSpec) -> Sequence[PciFunction]:
        """The token's functions, read again; none for a VF token whose VF is gone."""
        try:
            return self.host.token_functions(token.name, token.address)
        except HostError:
            if token.vf_of is None:
                raise
            return ()


def _addresses(spec: TokenSpec) -> frozenset[str]:
    return frozenset(f.address for f in spec.functions) | {spec.address}


def vf_specs(host: PciSource, addresses: Iterable[str]) -> list[TokenSpec]:
    """Each virtual function at these addresses, as a token of its own named by its
    address (what a scan of device holders takes); one that does not exist is left out."""
    found = []
    for vf in addresses:
        try:
            functions = tuple(host.token_functions(vf, vf))
        except HostError:
            continue
        found.append(TokenSpec(vf, vf, functions, cdi=False))
    return found
