"""`nvidia-persistenced`, handled per GPU: persistence mode off for a claimed GPU,
back on when it comes home.

The daemon keeps /dev/nvidiaN of every GPU in persistence mode open, so that
the driver keeps them initialised.  Stopping the daemon for one claim would end
persistence on every GPU of the host; `nvidia-smi -i ADDRESS -pm 0` asks it to
let go of just the claimed one (with the daemon running, nvidia-smi hands the
request to it), and `-pm 1` takes it back.  A holder here is
`nvidia-persistence:ADDRESS`; it "runs" while that GPU is in persistence mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind
from charly_arbiter.core.pci import parse_address
from charly_arbiter.errors import CommandFailed, HolderError
from charly_arbiter.host import run

KIND = HolderKind.NVIDIA_PERSISTENCE


def persistence_ref(address: str) -> Claimant:
    return Claimant.of(KIND, address)


class NvidiaPersistence:
    kind = KIND

    def __init__(self, config: Config, nvidia_smi: str | None = None) -> None:
        self.config = config
        self.nvidia_smi = nvidia_smi

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        return []  # found by the process scan, which sees the daemon's open nodes

    def is_running(self, ref: Claimant) -> bool:
        result = run.run(
            [
                self._program(ref, "query"),
                "--query-gpu=persistence_mode",
                "--format=csv,noheader",
                "-i",
                _address(ref),
            ],
            check=False,
            timeout=self.config.timeouts.holder_stop,
        )
        return result.returncode == 0 and result.stdout.strip() == "Enabled"

    def stop(self, ref: Claimant) -> None:
        self._set(ref, "stop", "0")

    def start(self, ref: Claimant) -> None:
        self._set(ref, "start", "1")

    def _set(self, ref: Claimant, action: str, mode: str) -> None:
        argv = [self._program(ref, action), "-i", _address(ref), "-pm", mode]
        try:
            run.run(argv, timeout=self.config.timeouts.holder_stop)
        except CommandFailed as error:
            raise HolderError(ref, action, str(error)) from error

    def _program(self, ref: Claimant, action: str) -> str:
        program = self.nvidia_smi or run.which("nvidia-smi")
        if program is None:
            raise HolderError(ref, action, "nvidia-smi is not installed")
        return program


def _address(ref: str) -> str:
    claimant = Claimant.parse(ref)
    if claimant.kind != KIND:
        raise HolderError(ref, "handle", "it is not an NVIDIA persistence holder")
    return parse_address(claimant.name)
