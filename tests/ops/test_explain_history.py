"""`explain` and `history` through the real CLI on the simulated host, after a
refusal, a real kill -9 in the middle of a claim, and a failed driver switch."""

from __future__ import annotations

import json
import re
import shlex
import signal

from opstools import assert_golden, normalise
from simhosts import holder


def test_after_a_refused_start_explain_names_the_holder_that_refused_it(sim):
    refused = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu1")
    assert refused.returncode == 3
    for subject in ("gpu1", "libvirt:win11"):
        text = sim.cli("explain", subject, check=True).stdout
        assert "refused" in text
        assert "systemd:display-manager.service, which is not preemptible" in text, text
    # Not idle: what holds it is not preemptible, and says so (issue 17).
    said = sim.cli("explain", "gpu1").stdout
    assert "gpu1 (0000:0b:00.0) is in use, though no lease holds it" in said
    assert "exclusive claims on it are refused while that runs" in said


def test_after_kill_9_mid_claim_history_shows_the_step_and_explain_the_fix(sim):
    crashed = sim.cli(
        "acquire",
        "--exclusive",
        "libvirt:win11",
        "gpu0",
        env=sim.env(CHARLY_ARBITER_CRASH_AT="acquire.switch"),
    )
    assert crashed.returncode == -signal.SIGKILL

    history = sim.cli("history", "--claimant", "libvirt:win11", check=True).stdout
    last = history.strip().splitlines()[-1]
    assert "switching gpu0 to vfio-pci" in last and "[INTERRUPTED: process" in last, history
    documents = json.loads(sim.cli("history", "--json", "--token", "gpu0", check=True).stdout)
    assert [d["event"] for d in documents if d["interrupted"]] == ["switching"]
    assert documents[-1]["pid"] == documents[0]["pid"]

    explained = sim.cli("explain", "gpu0", check=True).stdout
    assert_golden("explain-after-kill.txt", normalise(explained))
    fix = re.search(r"Fix: run `(charly-arbiter restore [^`]+)`", explained)
    assert fix is not None, explained
    assert fix.group(1) == "charly-arbiter restore libvirt:win11"

    # The command explain gave is the one that fixes it.
    args = shlex.split(fix.group(1))[1:]
    assert sim.cli(*args).returncode == 0
    status = sim.status()
    assert status["leases"] == [] and status["stranded"] == []
    assert status["tokens"]["gpu0"]["drivers"] == {
        "0000:0a:00.0": "nvidia",
        "0000:0a:00.1": "snd_hda_intel",
    }
    assert sim.host().is_running("container:llm")
    assert "`restore` cleaned up after it" in sim.cli("explain", "libvirt:win11").stdout


def fail_switches_of_gpu0_audio(sim) -> None:
    """Fault injection of the simulated host: every switch of 0000:0a:00.1 fails."""
    host = (sim.sim_dir / "host.toml").read_text()
    marker = 'driver = "snd_hda_intel"\n'
    assert marker in host
    sim.set_host(host.replace(marker, marker + "fail_switch = true\n"))


def test_a_failed_switch_is_explained_with_the_poison_clear_command(sim):
    fail_switches_of_gpu0_audio(sim)
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 1
    explained = sim.cli("explain", "gpu0", check=True).stdout
    assert "gpu0 is poisoned since" in explained
    assert "simulated failure" in explained
    assert "run `charly-arbiter poison clear gpu0`" in explained
    assert "The last failure on gpu0 was at" in explained
    kinds = [d["event"] for d in json.loads(sim.cli("history", "--json").stdout)]
    assert kinds[kinds.index("switching") :][:3] == ["switching", "poisoned", "failed"]
    assert sim.cli("poison", "clear", "gpu0").returncode == 0
    assert "poison of gpu0 was cleared" in sim.cli("history", "--token", "gpu0").stdout


def test_explain_a_holder_that_was_stopped_for_a_claim(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    text = sim.cli("explain", "systemd:ollama.service", check=True).stdout
    assert text.splitlines() == [
        "systemd:ollama.service holds no lease.",
        "systemd:ollama.service was stopped to make room for libvirt:win11 on gpu0; "
        "it will be started again when libvirt:win11 releases it.",
    ]
    claimant = sim.cli("explain", "libvirt:win11").stdout
    assert "libvirt:win11 holds gpu0 (exclusive) since" in claimant


def test_explain_an_unknown_token_lists_the_known_ones(sim):
    result = sim.cli("explain", "gpu9")
    assert result.returncode == 2
    assert "there is no token named 'gpu9' (known tokens: gpu0, gpu1)" in result.stderr


def test_explain_a_stranger(sim):
    text = sim.cli("explain", "libvirt:nobody", check=True).stdout
    assert text.splitlines() == [
        "libvirt:nobody holds no lease.",
        "Nothing about it is in the history either.",
    ]


def test_history_filters_by_token_claimant_and_time(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.cli("acquire", "--exclusive", "libvirt:other", "gpu1")
    sim.stopped("libvirt:win11")
    sim.cli("release", "libvirt:win11", check=True)

    everything = json.loads(sim.cli("history", "--json", check=True).stdout)
    assert everything[0]["event"] == "claim"
    on_gpu1 = json.loads(sim.cli("history", "--json", "--token", "gpu1").stdout)
    assert [d["event"] for d in on_gpu1] == ["refused"]
    on_gpu0 = json.loads(sim.cli("history", "--json", "--token", "gpu0").stdout)
    assert "preempted" in [d["event"] for d in on_gpu0], "steps of a claim on gpu0 belong to it"
    assert "refused" not in [d["event"] for d in on_gpu0]
    llm = json.loads(sim.cli("history", "--json", "--claimant", "container:llm").stdout)
    assert [d["event"] for d in llm] == ["stopping", "preempted", "starting", "restored"]
    assert len(json.loads(sim.cli("history", "--json", "--since", "1h").stdout)) == len(everything)
    assert sim.cli("history", "--since", "2999-01-01").stdout.strip() == "no events"
    bad = sim.cli("history", "--since", "soon")
    assert bad.returncode == 2 and "'soon' is not a time" in bad.stderr


def test_history_skips_a_torn_line_with_a_note(sim):
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    with open(sim.state_dir / "history.jsonl", "ab") as handle:
        handle.write(b'{"time": "2026-')
    result = sim.cli("history")
    assert result.returncode == 0
    assert "container:llm claims gpu0 (shared)" in result.stdout
    assert "not a complete record (torn?); skipped" in result.stderr


def test_explain_a_shared_token_and_who_brings_its_holders_back(sim):
    """A VM that has gpu0 passed through makes room for the first shared claim; the
    units and containers that use gpu0 on its home driver stay beside it."""
    host = (sim.sim_dir / "host.toml").read_text()
    sim.set_host(host + "\n" + holder("libvirt", "vm", ["gpu0"], preemptible=True))
    sim.cli("acquire", "--shared", "container:a", "gpu0", check=True)
    sim.cli("acquire", "--shared", "container:b", "gpu0", check=True)
    lines = normalise(sim.cli("explain", "gpu0", check=True).stdout).splitlines()
    assert lines[0] == (
        "gpu0 (0000:0a:00.0) is shared by container:a since <TIME> (<AGE> ago) "
        "and container:b since <TIME> (<AGE> ago)."
    )
    assert "It is also used by container:llm, which an exclusive claim stops." in lines
    assert "It is also used by systemd:ollama.service, which an exclusive claim stops." in lines
    assert (
        "For container:a, libvirt:vm was stopped; "
        "it will be started again when the last shared lease on gpu0 ends."
    ) in lines
