"""The simulated host from the command line: `sim init` and the `sim` commands, and
`--host sim:DIR` is self-contained: this machine's /etc/charly-arbiter is never read
and its /var/lib/charly-arbiter never written.

The commands run as real processes in a mount namespace of their own (`unshare -m`,
as root) where /etc and /var/lib are overlays of the real ones: every write there
lands in an upper directory the test inspects afterwards, and a poisoned
/etc/charly-arbiter (a configuration that is not TOML, an attached.d record that
is not either) fails any command that reads it.  The real /etc and /var/lib are
not touched.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# (argv after `charly-arbiter`, the exit it must have, a piece of what it prints)
COMMANDS = [
    (["sim", "init", "{dir}"], 0, "keeps its configuration"),
    (["--host", "sim:{dir}", "status"], 0, "gpu1"),
    (["--host", "sim:{dir}", "acquire", "--exclusive", "libvirt:win11", "gpu0"], 0, "holds gpu0"),
    (["--host", "sim:{dir}", "history", "--token", "gpu0"], 0, "claims gpu0"),
    (["--host", "sim:{dir}", "explain", "libvirt:win11"], 0, "holds gpu0"),
    (["--host", "sim:{dir}", "poison", "list"], 0, "no token is poisoned"),
    (["--host", "sim:{dir}", "metrics"], 0, "charly_arbiter_leases"),
    (["--host", "sim:{dir}", "doctor", "--hook", "{dir}/host.toml"], 0, "state dir"),
    (["--host", "sim:{dir}", "attach", "llm@1.service", "gpu1"], 0, "{dir}/units/"),
    (["--host", "sim:{dir}", "detach", "llm@1.service"], 0, "detached"),
    (["--host", "sim:{dir}", "sim", "stop", "libvirt:win11"], 0, ""),
    (["--host", "sim:{dir}", "restore", "--stranded"], 0, "restored libvirt:win11"),
    (["--host", "sim:{dir}", "detect"], 2, "this machine's PCI devices"),
    (["--host", "sim:{dir}", "plan", "libvirt:win11"], 2, "needs libvirt"),
    (["--host", "sim:{dir}", "sim", "show"], 0, "boot_id"),
    (["status", "--json"], 0, '"gpu0"'),  # CHARLY_ARBITER_HOST=sim:{dir}, below
    (["acquire", "--exclusive", "libvirt:c", "gpu1"], 3, "not preemptible"),
]


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_a_simulated_host_never_reaches_for_this_machines_files(tmp_path: Path) -> None:
    upper_etc, upper_lib = tmp_path / "etc", tmp_path / "lib"
    for layer in (upper_etc, upper_lib):
        (layer / "upper").mkdir(parents=True)
        (layer / "work").mkdir()
    directory = tmp_path / "demo dir"  # a space: quoted in every hint and file
    results = tmp_path / "results"
    lines = [
        "set -e",
        f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper_etc}/upper,"
        f"workdir={upper_etc}/work /etc",
        f"mount -t overlay overlay -o lowerdir=/var/lib,upperdir={upper_lib}/upper,"
        f"workdir={upper_lib}/work /var/lib",
        "mkdir -p /etc/charly-arbiter/attached.d /var/lib/charly-arbiter",
        "printf 'host = [\\n' > /etc/charly-arbiter/arbiter.toml",
        "printf 'kind = \\n' > /etc/charly-arbiter/attached.d/poison.toml",
        "echo sentinel > /var/lib/charly-arbiter/sentinel",
        "chmod 700 /var/lib/charly-arbiter",
        "set +e",
    ]
    python = shlex.join([sys.executable, "-m", "charly_arbiter"])
    for index, (argv, _, _) in enumerate(COMMANDS):
        words = [word.format(dir=directory) for word in argv]
        if "restore" in argv:  # past the sim's claim_grace (1 s): younger is not stranded
            lines.append("sleep 1.2")
        env = ""
        if argv[0] not in ("--host", "sim"):
            env = f"CHARLY_ARBITER_HOST={shlex.quote(f'sim:{directory}')} "
        out = f"{results}.{index}"
        lines.append(
            f"{env}{python} {shlex.join(words)} > {out}.out 2> {out}.err; echo $? > {out}.rc"
        )
    lines.append(f"ls -A /var/lib/charly-arbiter > {results}.varlib")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")} | {
        "PYTHONPATH": str(REPO)
    }
    ran = subprocess.run(
        ["/usr/bin/unshare", "-m", "--propagation", "private", "/bin/sh", "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr
    for index, (argv, code, says) in enumerate(COMMANDS):
        out = Path(f"{results}.{index}.out").read_text()
        err = Path(f"{results}.{index}.err").read_text()
        rc = int(Path(f"{results}.{index}.rc").read_text())
        assert rc == code, (argv, rc, out, err)
        assert says.format(dir=directory) in out + err, (argv, says, out, err)
        assert "/etc/charly-arbiter" not in err, (argv, err)
    # Nothing under /etc or /var/lib changed but what the test itself put there.
    written = sorted(
        str(path.relative_to(upper_etc / "upper")) for path in (upper_etc / "upper").rglob("*")
    )
    assert written == [
        "charly-arbiter",
        "charly-arbiter/arbiter.toml",
        "charly-arbiter/attached.d",
        "charly-arbiter/attached.d/poison.toml",
    ]
    written = sorted(
        str(path.relative_to(upper_lib / "upper")) for path in (upper_lib / "upper").rglob("*")
    )
    assert written == ["charly-arbiter", "charly-arbiter/sentinel"]
    # (what the real /var/lib/charly-arbiter holds shows through the overlay: not ours)
    assert "sentinel" in Path(f"{results}.varlib").read_text().split()
    # The simulated host kept everything in its directory.
    assert (directory / "state" / "ledger.toml").is_file()
    assert (directory / "state" / "history.jsonl").is_file()
    assert json.loads(Path(f"{results}.15.out").read_text())["leases"] == []


def test_sim_init_makes_a_host_its_commands_stop_start_and_reboot(tmp_path: Path) -> None:
    """`sim init DIR`, then every command with `--config DIR/arbiter.toml`: `sim show`,
    `sim stop`/`start` (a claimant's lease strands and comes back), `sim reboot` (a new
    boot strands it again); a second `sim init` overwrites nothing (exit 3)."""
    directory = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "charly_arbiter", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
        )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run("--config", str(directory / "arbiter.toml"), *args)

    init = run("sim", "init", str(directory))
    assert init.returncode == 0, init.stderr
    assert (directory / "host.toml").exists() and (directory / "arbiter.toml").exists()
    config = directory / "arbiter.toml"
    assert "claim_grace = 1\n" in config.read_text()
    shown = json.loads(cli("sim", "show").stdout)
    assert shown["running"] == {
        "container:llm": True,
        "systemd:display-manager.service": True,
    }
    boot = shown["boot_id"]
    # Within its claim_grace a claimant that does not run is not stranded yet (a VM
    # between its prepare hook and its start), and `restore --stranded` says so.
    config.write_text(config.read_text().replace("claim_grace = 1\n", "claim_grace = 600\n"))
    assert cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 0
    assert cli("sim", "stop", "libvirt:win11").returncode == 0
    assert json.loads(cli("status", "--json").stdout)["stranded"] == []
    early = cli("restore", "--stranded")
    assert early.returncode == 0, early.stderr
    assert early.stdout.startswith("nothing to restore yet: libvirt:win11 (claimed "), early
    assert "600 s after its claim (timeouts.claim_grace" in early.stdout, early
    assert json.loads(cli("status", "--json").stdout)["leases"] != []
    # A claimant is judged at once.
    config.write_text(config.read_text().replace("claim_grace = 600\n", "claim_grace = 0.001\n"))
    assert json.loads(cli("status", "--json").stdout)["stranded"] == ["libvirt:win11"]
    assert cli("sim", "start", "libvirt:win11").returncode == 0
    assert json.loads(cli("status", "--json").stdout)["stranded"] == []
    assert cli("sim", "reboot").returncode == 0
    assert json.loads(cli("sim", "show").stdout)["boot_id"] != boot
    assert json.loads(cli("status", "--json").stdout)["stranded"] == ["libvirt:win11"]
    assert cli("restore", "--stranded").returncode == 0
    again = run("sim", "init", str(directory))
    assert again.returncode == 3 and "exists" in again.stderr  # refused: nothing overwritten
    local = cli("--host", "local", "sim", "show")
    assert local.returncode == 2 and "sim:DIR" in local.stderr
