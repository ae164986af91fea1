"""Containers listed in arbiter.toml, through their runtime's CLI.

The CLI is the outermost seam: a small script stands in for `docker` (CI has
Podman, not Docker; tests/oci runs real Podman containers), keeping the
container's state in a file and recording each argv, so the tests check the
real subprocess path: absolute program, argv list, `--` before the name.

systemd units listed as holders run against the real systemctl of a real
systemd, in the systemd guest: tests/kernel/test_systemd_units.py (a unit named
like an option, kept a name by `--`; a start that fails, a HolderError naming
the unit; units stopped, drained and started again by a claim).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.config import Config, HolderConfig, Timeouts
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.errors import HolderError
from charly_arbiter.host.holders.container import ContainerHolders

FAKE = """#!/bin/sh
# Records its argv, one per line, then acts on STATE/<last argument>.
printf '%s\\n' "$@" >> {log}
echo --- >> {log}
for last; do :; done
case "$1 $2" in
  "container inspect") if [ -e "{state}/$last" ]; then echo true; else echo false; fi ;;
  stop*) [ -e "{state}/$last" ] && rm -f "{state}/$last" ;;
  start*) touch "{state}/$last" ;;
  *) exit 64 ;;
esac
"""

GPU0 = TokenSpec("gpu0", "0000:0a:00.0", ())


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
