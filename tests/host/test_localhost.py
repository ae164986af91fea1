"""The arbiter driving LocalHost over the fake tree: claims, refusals, poison."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace

import pytest

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.host import TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode
from charly_arbiter.errors import ClaimRefused, HostError, SwitchFailed, SwitchHung

GPU = "0000:0a:00.0"
AUDIO = "0000:0a:00.1"


def arbiter_for(host) -> Arbiter:
    return Arbiter(host.config, host, Ledger(host.config.state_dir, 5))


def test_token_functions_and_gpus(make_host):
    host = make_host()
    assert [f.address for f in host.token_functions("gpu0", GPU)] == [GPU, AUDIO]
    assert [g.address for g in host.gpus()] == [GPU, "0000:0b:00.0"]
    with pytest.raises(HostError, match=r"no PCI device 0000:0e:00\.0"):
        host.token_functions("gpu9", "0000:0e:00.0")


def test_boot_id_comes_from_the_proc_root(make_host, tmp_path):
    proc = tmp_path / "fakeproc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "sys/kernel/random/boot_id").write_text("1234-abcd\n")
    host = make_host()
    host.proc_root = proc
    assert host.boot_id() == "1234-abcd"
    host.proc_root = tmp_path / "none"
    with pytest.raises(HostError, match="boot id"):
        host.boot_id()


def test_exclusive_claim_and_release_move_the_whole_group(make_host, kernel):
    host = make_host()
    arbiter = arbiter_for(host)
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert kernel.driver_of(GPU) == kernel.driver_of(AUDIO) == "vfio-pci"
    assert kernel.driver_of("0000:00:01.0") == "pcieport"  # the bridge stays
    assert (kernel.dev / "vfio/12").exists()
    arbiter.release_claimant("libvirt:win11", force=True)  # as the hook, told by libvirt
    assert (kernel.driver_of(GPU), kernel.driver_of(AUDIO)) == ("nvidia", "snd_hda_intel")


def test_a_device_holder_refuses_the_claim_with_its_pid_and_name(make_host, kernel):
    with open(kernel.dev / "dri" / "card1", "rb") as node:
        holder = subprocess.Popen(["/bin/sleep", "60"], stdin=node)
    try:
        with pytest.raises(ClaimRefused) as refused:
            arbiter_for(make_host()).acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
        assert f"process:{holder.pid}" in str(refused.value) and "sleep" in str(refused.value)
        assert kernel.driver_of(GPU) == "nvidia"
    finally:
        holder.kill()
        holder.wait()


def test_a_hanging_switch_poisons_the_token_and_the_claim_fails_promptly(make_host, kernel):
    kernel.hang_unbind.add("nvidia")
    arbiter = arbiter_for(make_host())  # driver_switch = 1 s
    started = time.monotonic()
    with pytest.raises(SwitchHung):
        arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert time.monotonic() - started < 5
    poison = arbiter.ledger.read().poison_of("gpu0")
    assert poison is not None and "did not return within 1 s" in poison.reason
    kernel.release.set()


def test_switching_a_function_outside_the_token_is_refused(make_host):
    host = make_host()
    token = TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))
    with pytest.raises(SwitchFailed, match="not a function of gpu0"):
        host.switch(token, {"0000:0b:00.0": "vfio-pci"})


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every command run through the one subprocess door (run.run), recorded, not run;
    `run.which` finds every program in /usr/bin (nvidia-ctk included)."""
    from charly_arbiter.host import run

    ran: list[list[str]] = []

    def record(argv: list[str], **options: object) -> run.Completed:
        ran.append(list(argv))
        return run.Completed(0, "", "")

    monkeypatch.setattr(run, "which", lambda program: f"/usr/bin/{program}")
    monkeypatch.setattr(run, "run", record)
    return ran


def test_cdi_is_regenerated_for_an_nvidia_gpu_on_either_driver(make_host, commands):
    """On vfio-pci too (issue 11): the regenerated spec no longer lists the GPU."""
    host = make_host()
    token = TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))
    generate = ["/usr/bin/nvidia-ctk", "cdi", "generate", f"--output={host.cdi_spec}"]
    host.switch(token, {GPU: "vfio-pci", AUDIO: "vfio-pci"})
    host.regenerate_cdi(token)
    assert commands == [generate]
    host.switch(token, {GPU: "nvidia", AUDIO: "snd_hda_intel"})
    host.regenerate_cdi(token)
    assert commands == [generate, generate]


def test_cdi_is_not_regenerated_for_a_gpu_of_another_vendor(make_host, commands):
    host = make_host()
    token = TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))
    other = TokenSpec("gpu0", GPU, tuple(replace(f, vendor="1002") for f in token.functions))
    host.regenerate_cdi(other)
    assert commands == []


def test_cdi_regeneration_without_nvidia_ctk_logs_and_goes_on(make_host, caplog, monkeypatch):
    from charly_arbiter.host import run

    monkeypatch.setattr(run, "which", lambda program: None)
    monkeypatch.setattr(run, "run", lambda *args, **options: pytest.fail(f"ran {args}"))
    host = make_host()
    token = TokenSpec("gpu0", GPU, tuple(host.token_functions("gpu0", GPU)))
    with caplog.at_level("INFO", logger="charly_arbiter.host.local"):
        host.regenerate_cdi(token)
    assert "nvidia-ctk is not installed" in caplog.text


def test_the_default_isolated_writes_switch_the_fake_tree_too(make_host, kernel):
    """LocalHost's default: unbind and probe are written by a helper process."""
    host = make_host(isolate_writes=True)
    arbiter = arbiter_for(host)
    arbiter.acquire("libvirt:win11", Mode.EXCLUSIVE, ["gpu0"])
    assert kernel.driver_of(GPU) == kernel.driver_of(AUDIO) == "vfio-pci"
    arbiter.release_claimant("libvirt:win11", force=True)  # as the hook, told by libvirt
    assert (kernel.driver_of(GPU), kernel.driver_of(AUDIO)) == ("nvidia", "snd_hda_intel")
    unbinds = [w for w in kernel.writes if w[0].endswith("unbind")]
    assert unbinds == [], "unbind is written by the helper, not by this process"
