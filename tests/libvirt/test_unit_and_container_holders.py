"""systemd units and containers listed in arbiter.toml, through their CLIs.

The CLIs are the outermost seam: a small script stands in for `systemctl` /
`podman` (there is no systemd or container runtime in CI), keeping the
unit's state in a file and recording each argv, so the tests check the real
subprocess path: absolute program, argv list, `--` before the name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.config import Config, HolderConfig, Timeouts
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.errors import HolderError
from charly_arbiter.host.holders.container import ContainerHolders
from charly_arbiter.host.holders.systemd import SystemdHolders

FAKE = """#!/bin/sh
# Records its argv, one per line, then acts on STATE/<last argument>.
printf '%s\\n' "$@" >> {log}
echo --- >> {log}
for last; do :; done
case "$1 $2" in
  "is-active --quiet") [ -e "{state}/$last" ] ;;
  "container inspect") if [ -e "{state}/$last" ]; then echo true; else echo false; fi ;;
  stop*) [ -e "{state}/$last" ] && rm -f "{state}/$last" ;;
  start*) touch "{state}/$last" ;;
  *) exit 64 ;;
esac
"""

GPU0 = TokenSpec("gpu0", "0000:0a:00.0", ())
GPU1 = TokenSpec("gpu1", "0000:0b:00.0", ())


@pytest.fixture
def fake(tmp_path: Path) -> tuple[str, Path, Path]:
    state, log = tmp_path / "state", tmp_path / "argv.log"
    state.mkdir()
    program = tmp_path / "fake-cli"
    program.write_text(FAKE.format(log=log, state=state))
    program.chmod(0o755)
    return str(program), state, log


def calls(log: Path) -> list[list[str]]:
    return [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()]


def config(*holders: HolderConfig) -> Config:
    return Config(holders=holders, timeouts=Timeouts(holder_stop=10, holder_start=10))


def test_systemd_unit_listed_for_a_token_is_stopped_and_started(
    fake: tuple[str, Path, Path],
) -> None:
    program, state, log = fake
    (state / "-rf-ollama.service").touch()
    source = SystemdHolders(
        config(HolderConfig("systemd:-rf-ollama.service", ("gpu0",), preemptible=True)),
        systemctl=program,
    )
    [holder] = source.holders([GPU0, GPU1])
    assert (holder.ref, holder.running, holder.preemptible) == (
        "systemd:-rf-ollama.service",
        True,
        True,
    )
    assert source.holders([GPU1]) == []
    source.stop(holder.ref)
    assert not source.is_running(holder.ref)
    source.start(holder.ref)
    assert source.is_running(holder.ref)
    assert ["stop", "--", "-rf-ollama.service"] in calls(log)
    assert ["start", "--", "-rf-ollama.service"] in calls(log)


def test_systemd_failure_is_a_holder_error_naming_the_unit(fake: tuple[str, Path, Path]) -> None:
    program, _, _ = fake
    source = SystemdHolders(config(), systemctl=program)
    with pytest.raises(HolderError, match=r"could not stop systemd:gone.service"):
        source.stop("systemd:gone.service")  # the fake exits 1: not running


def test_container_holder_through_its_runtime(fake: tuple[str, Path, Path]) -> None:
    program, state, log = fake
    (state / "llm").touch()
    listed = HolderConfig("container:llm", ("gpu0",), preemptible=True, runtime="docker")
    source = ContainerHolders(config(listed), programs={"docker": program})
    [holder] = source.holders([GPU0])
    assert holder.running and holder.how == "docker stop"
    source.stop("container:llm")
    assert not source.is_running("container:llm")
    source.start("container:llm")
    assert source.is_running("container:llm")
    argvs = calls(log)
    assert ["container", "inspect", "--format", "{{.State.Running}} {{.Id}}", "--", "llm"] in argvs
    assert ["stop", "--time", "5", "--", "llm"] in argvs
    assert ["start", "--", "llm"] in argvs


def test_missing_runtime_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without podman: the fixed PATH the runtime is looked up on is empty."""
    from charly_arbiter.host import run

    monkeypatch.setattr(run, "SAFE_PATH", str(tmp_path))
    assert run.which("podman") is None
    with pytest.raises(HolderError, match="podman is not installed"):
        ContainerHolders(config()).stop("container:llm")
