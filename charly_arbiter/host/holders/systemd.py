"""systemd units listed in arbiter.toml as holders, through `systemctl`.

A unit cannot be discovered as a GPU user by itself (its processes can, by
the process holder scan), so the operator lists the ones the arbiter may
stop: `[[holders]] kind = "systemd"`, or `charly-arbiter attach`.  A process
in a listed unit's cgroup is that unit's: the scan does not report it as a
holder of its own.  `systemctl` is run by absolute path, with `--` before the
unit name.
"""

from __future__ import annotations

from collections.abc import Sequence

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind
from charly_arbiter.errors import CommandFailed, HolderError
from charly_arbiter.host import run
from charly_arbiter.host.holders import listed_holders

KIND = HolderKind.SYSTEMD


class SystemdHolders:
    kind = KIND

    def __init__(self, config: Config, systemctl: str | None = None) -> None:
        self.config = config
        self.systemctl = systemctl or run.which("systemctl")
        self.listed = [h for h in config.holders if h.ref.startswith(f"{KIND}:")]

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        return listed_holders(
            self.listed,
            tokens,
            self.is_running,
            lambda entry: "drain" if entry.drains_only else "systemctl stop",
        )

    def cgroup_owner(self, paths: Sequence[str]) -> Claimant | None:
        """The listed unit a cgroup path runs under (`/system.slice/ollama.service/…`)."""
        units = {entry.ref.name: entry.ref for entry in self.listed}
        for path in paths:
            for part in reversed(path.split("/")):
                if part in units:
                    return units[part]
        return None

    def is_running(self, ref: Claimant) -> bool:
        result = run.run(
            [self._program(ref, "query"), "is-active", "--quiet", "--", _unit(ref)],
            check=False,
            timeout=self.config.timeouts.holder_stop,
        )
        return result.returncode == 0

    def stop(self, ref: Claimant) -> None:
        self._systemctl(ref, "stop", self.config.timeouts.holder_stop)

    def start(self, ref: Claimant) -> None:
        self._systemctl(ref, "start", self.config.timeouts.holder_start)

    def _systemctl(self, ref: Claimant, verb: str, timeout: float) -> None:
        try:
            run.run([self._program(ref, verb), verb, "--", _unit(ref)], timeout=timeout)
        except CommandFailed as error:
            raise HolderError(ref, verb, str(error)) from error

    def _program(self, ref: Claimant, action: str) -> str:
        if self.systemctl is None:
            raise HolderError(ref, action, "systemctl is not installed")
        return self.systemctl


def _unit(ref: str) -> str:
    claimant = Claimant.parse(ref)
    if claimant.kind != KIND:
        raise HolderError(ref, "handle", "it is not a systemd unit")
    return claimant.name
