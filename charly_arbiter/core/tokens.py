"""The tokens of this host, read once per command.

A token is a GPU with every function of its IOMMU group: configured by name in
arbiter.toml, or, without any, every detected GPU named after its address.
An SR-IOV virtual function is a token only when configured (by its address):
VFs come and go with their physical function's count, and which of them go to
VMs is the operator's choice; unconfigured, a display-class VF would pass for
a GPU of its own, and its physical function's token already knows it.
Reading one means reading its group's functions and their drivers from the
host, so the catalogue does it once and hands the same specs to everyone in
the command (the hook's claim lookup, the claim itself, status).  `reread`
is for the moments drivers may have moved since (a claim that waited).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Host, PciFunction, TokenSpec
from charly_arbiter.errors import UnknownToken


class TokenCatalogue:
    def __init__(self, config: Config, host: Host) -> None:
        self.config = config
        self.host = host
        self._specs: dict[str, TokenSpec] | None = None

    def all(self) -> dict[str, TokenSpec]:
        """Every token, with each function's driver as read the first time."""
        if self._specs is None:
            specs: dict[str, TokenSpec] = {}
            if self.config.tokens:
                for token in self.config.tokens:
                    functions = tuple(self.host.token_functions(token.name, token.address))
                    specs[token.name] = TokenSpec(
                        token.name,
                        token.address,
                        functions,
                        token.home_driver,
                        token.cdi,
                        token.console or self.config.console,
                    )
            else:
                for gpu in self.host.gpus():
                    if gpu.is_virtual:
                        continue
                    functions = tuple(self.host.token_functions(gpu.address, gpu.address))
                    specs[gpu.address] = TokenSpec(
                        gpu.address, gpu.address, functions, console=self.config.console
                    )
            self._specs = specs
        return self._specs

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

    def functions_now(self, token: TokenSpec) -> Sequence[PciFunction]:
        return self.host.token_functions(token.name, token.address)
