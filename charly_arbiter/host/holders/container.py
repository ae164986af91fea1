"""Containers listed in arbiter.toml as holders, through podman or docker.

Each `[[holders]] kind = "container"` names its runtime (podman by default).
The CLI is run by absolute path with an argv list and `--` before the
container name; whether a container runs is read from its exit status and a
fixed Go template, never from localized text.
"""

from __future__ import annotations

from collections.abc import Sequence

from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant
from charly_arbiter.errors import CommandFailed, HolderError
from charly_arbiter.host import run
from charly_arbiter.host.holders import listed_holders

KIND = "container"


class ContainerHolders:
    kind = KIND

    def __init__(self, config: Config, programs: dict[str, str] | None = None) -> None:
        self.config = config
        self.programs = programs or {}
        self.listed = {h.ref: h for h in config.holders if h.ref.startswith(f"{KIND}:")}

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        return listed_holders(
            self.listed.values(), tokens, self.is_running, lambda entry: f"{entry.runtime} stop"
        )

    def is_running(self, ref: Claimant) -> bool:
        program, name = self._target(ref, "query")
        result = run.run(
            [program, "container", "inspect", "--format", "{{.State.Running}}", "--", name],
            check=False,
            timeout=self.config.timeouts.holder_stop,
        )
        return result.returncode == 0 and result.stdout.strip() == "true"

    def stop(self, ref: Claimant) -> None:
        program, name = self._target(ref, "stop")
        grace = str(max(1, int(self.config.timeouts.holder_stop) - 5))
        self._run(ref, "stop", [program, "stop", "--time", grace, "--", name])

    def start(self, ref: Claimant) -> None:
        program, name = self._target(ref, "start")
        self._run(ref, "start", [program, "start", "--", name])

    def _run(self, ref: Claimant, action: str, argv: list[str]) -> None:
        timeout = self.config.timeouts.holder_stop + 5
        try:
            run.run(argv, timeout=timeout)
        except CommandFailed as error:
            raise HolderError(ref, action, str(error)) from error

    def _target(self, ref: Claimant, action: str) -> tuple[str, str]:
        claimant = Claimant.parse(ref)
        kind, name = claimant.kind, claimant.name
        if kind != KIND:
            raise HolderError(ref, action, "it is not a container")
        listed: HolderConfig | None = self.listed.get(ref)
        runtime = listed.runtime if listed else "podman"
        program = self.programs.get(runtime) or run.which(runtime)
        if program is None:
            raise HolderError(ref, action, f"{runtime} is not installed")
        return program, name
