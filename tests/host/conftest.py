"""Fixtures for the host layer: a fake kernel tree and a LocalHost over it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fakesys import FakeKernel, gpu_with_audio

from charly_arbiter.core.config import Config, Timeouts, TokenConfig
from charly_arbiter.host.local import LocalHost
from charly_arbiter.host.sysfs import Roots

GPU = "0000:0a:00.0"
AUDIO = "0000:0a:00.1"


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    return gpu_with_audio(tmp_path)


def make_config(tmp_path: Path, **changes: object) -> Config:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    fields: dict[str, object] = {
        "state_dir": state,
        "timeouts": Timeouts(driver_switch=1.0, holder_stop=2.0, lock_wait=5.0),
        "tokens": (TokenConfig("gpu0", GPU),),
    }
    fields.update(changes)
    return Config(**fields)  # type: ignore[arg-type]


@pytest.fixture
def make_host(tmp_path: Path, kernel: FakeKernel) -> Callable[..., LocalHost]:
    """A LocalHost over the fake tree, with the real /proc (holders are real processes)."""

    def make(
        isolate_writes: bool = False, modules_root: Path | None = None, **changes: object
    ) -> LocalHost:
        config = make_config(tmp_path, **changes)
        return LocalHost(
            config,
            roots=Roots(sys=kernel.sys, dev=kernel.dev),
            writer=kernel.write,
            sources={},
            isolate_writes=isolate_writes,
            load_module=kernel.modprobe,
            **({"modules_root": modules_root} if modules_root else {}),
        )

    return make
