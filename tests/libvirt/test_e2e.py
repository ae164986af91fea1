"""End to end on a real libvirtd: real QEMU/TCG domains, the real hook, the real CLI.

Each scenario asserts the ledger (through `status --json`) and which domains
run.  The PCI side is simulated (tests/libvirt/libvirtd.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from tests.libvirt.libvirtd import Libvirt, claim

pytestmark = [pytest.mark.slow, pytest.mark.libvirt]

# Destroyed when preempted (fast); scenario 1 uses the default, shutdown then destroy.
SHARED_HOLDER = claim("shared", ("gpu0",), preemptible="yes", stop="destroy")
SHUTDOWN_HOLDER = claim("shared", ("gpu0",), preemptible="yes")
EXCLUSIVE = claim("exclusive", ("gpu0",))


def test_domain_without_claim_starts_and_stops_with_nothing_in_the_ledger(lv: Libvirt) -> None:
    """Scenario 7."""
    plain = lv.define("plain")
    lv.virsh("start", plain)
    assert lv.running() == {plain}
    lv.virsh("destroy", plain)
    assert lv.running() == set()
    assert lv.status()["leases"] == []
    assert lv.ledger_text() == ""


def test_exclusive_claimant_preempts_shared_holder_and_brings_it_back(lv: Libvirt) -> None:
    """Scenario 1: the holder is shut down (then destroyed after holder_stop) and restarted."""
    holder = lv.define("holder", SHUTDOWN_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    assert lv.leases()[f"libvirt:{holder}"]["mode"] == "shared"

    logged = len(lv.hook_log_lines())
    lv.virsh("start", vm)
    assert lv.running() == {vm}
    leases = lv.leases()
    assert list(leases) == [f"libvirt:{vm}"]
    # The holder's own hook ran, nested, while the claimant's prepare hook waited on libvirt.
    lines = lv.hook_log_lines()[logged:]
    stopping = next(
        i
        for i, (_, m) in enumerate(lines)
        if m.endswith(f"stopping libvirt:{holder} (virsh shutdown)")
    )
    nested = next(
        i
        for i, (_, m) in enumerate(lines)
        if m == f"libvirt:{holder} stopped (no reason given) by the arbiter"
    )
    held = next(i for i, (_, m) in enumerate(lines) if m.startswith(f"libvirt:{vm} holds gpu0"))
    assert stopping < nested < held
    assert lines[stopping][0] == lines[held][0] != lines[nested][0]
    assert leases[f"libvirt:{vm}"]["stopped"] == [f"libvirt:{holder}"]
    token = lv.status()["tokens"]["gpu0"]
    assert token["mode"] == "exclusive"
    assert set(token["drivers"].values()) == {"vfio-pci"}

    lv.virsh("destroy", vm)
    lv.wait_for("the holder to run again", lambda: lv.running() == {holder})
    lv.wait_for("the holder's shared lease", lambda: list(lv.leases()) == [f"libvirt:{holder}"])
    status = lv.status()
    assert status["leases"][0]["mode"] == "shared"
    assert status["tokens"]["gpu0"]["drivers"] == {
        "0000:0a:00.0": "nvidia",
        "0000:0a:00.1": "snd_hda_intel",
    }
    assert status["stranded"] == []


def test_second_exclusive_claimant_is_refused_and_its_release_touches_nothing(
    lv: Libvirt,
) -> None:
    """Scenarios 2 and 8: libvirt runs `stopped`/`release` for the refused domain too."""
    first = lv.define("first", EXCLUSIVE)
    second = lv.define("second", EXCLUSIVE)
    lv.virsh("start", first)
    before = lv.ledger_text()

    refused = lv.virsh("start", second, check=False)
    assert refused.returncode != 0
    assert "charly-arbiter:" in refused.stderr
    assert f"libvirt:{second} cannot claim gpu0" in refused.stderr
    assert f"held exclusively by libvirt:{first}" in refused.stderr
    assert lv.running() == {first}
    lv.settle()  # the refused domain's release hook, and anything it handed off, ended
    assert lv.ledger_text() == before
    lease = lv.leases()[f"libvirt:{first}"]
    assert (lease["mode"], lease["state"], lease["tokens"]) == ("exclusive", "active", ["gpu0"])
    assert lv.status()["tokens"]["gpu0"]["claimants"] == [f"libvirt:{first}"]


def test_shared_claims_are_refcounted_and_the_token_goes_home_once(lv: Libvirt) -> None:
    """Scenario 3: gpu1 is found on vfio-pci with no lease (bound there by hand).
    Nothing in the ledger says why (issue 17), so a VM's start on it fails closed
    until an operator decides; sent home, it is shared, refcounted, and never moves
    again."""
    from charly_arbiter.core.host import TokenSpec
    from charly_arbiter.host.sim import SimHost

    shared = claim("shared", ("gpu1",))
    one, two = lv.define("one", shared), lv.define("two", shared)
    SimHost(lv.sim_dir).switch(TokenSpec("gpu1", "0000:0b:00.0", ()), {"0000:0b:00.0": "vfio-pci"})
    before = len(lv.sim_state()["log"])

    def switches() -> list[str]:
        log = lv.sim_state()["log"][before:]
        return [line for line in log if line.startswith("switch 0000:0b")]

    refused = lv.virsh("start", one, check=False)
    assert refused.returncode != 0
    assert "on vfio-pci, and no lease or poison in the ledger accounts for it" in refused.stderr
    assert lv.running() == set() and switches() == []
    sent = lv.cli("send-home", "gpu1")
    assert sent.returncode == 0, sent.stderr
    lv.virsh("start", one)
    lv.virsh("start", two)
    assert lv.running() == {one, two}
    assert switches() == ["switch 0000:0b:00.0 nvidia"]
    status = lv.status()
    assert status["tokens"]["gpu1"]["mode"] == "shared"
    assert sorted(status["tokens"]["gpu1"]["claimants"]) == [f"libvirt:{one}", f"libvirt:{two}"]

    lv.virsh("destroy", one)
    assert list(lv.leases()) == [f"libvirt:{two}"]
    assert lv.status()["tokens"]["gpu1"]["driver"] == "nvidia"
    lv.virsh("destroy", two)
    lv.wait_for("the last lease to go", lambda: lv.leases() == {})
    assert switches() == ["switch 0000:0b:00.0 nvidia"]
    assert lv.status()["tokens"]["gpu1"] == {
        **lv.status()["tokens"]["gpu1"],
        "mode": "idle",
        "claimants": [],
    }


def test_killed_qemu_is_released_by_libvirt_stop_path(lv: Libvirt) -> None:
    """Scenario 4a: SIGKILL to the claimant's QEMU; libvirt runs release, the holder returns."""
    holder = lv.define("holder", SHARED_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    lv.virsh("start", vm)
    os.kill(lv.qemu_pid(vm), signal.SIGKILL)
    lv.wait_for("the holder to run again", lambda: lv.running() == {holder})
    lv.wait_for("only the holder's lease", lambda: list(lv.leases()) == [f"libvirt:{holder}"])
    assert lv.status()["stranded"] == []


def test_qemu_dying_while_libvirtd_is_down_strands_the_lease_until_restore(
    lv: Libvirt,
) -> None:
    """Scenario 4b: no libvirtd to run the hook; `status` says stranded, `restore` converges."""
    holder = lv.define("holder", SHARED_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    lv.virsh("start", vm)
    pid = lv.qemu_pid(vm)
    lv.stop_libvirtd()
    os.kill(pid, signal.SIGKILL)
    lv.wait_for("QEMU to die", lambda: not os.path.exists(f"/proc/{pid}/cmdline"))
    # Stranded once claim_grace has passed: waited for, as status says it.
    lv.wait_for("the lease to strand", lambda: lv.status()["stranded"] == [f"libvirt:{vm}"])
    assert "STRANDED" in lv.cli("status").stdout

    lv.start_daemons()
    done = lv.cli("restore", "--stranded")
    # libvirtd, back, may be releasing the dead domain itself (its reconnect finds QEMU
    # gone and runs the release hook): restore then refuses, naming that release's
    # process, and says to wait for it and try again, as an operator would.
    releasing = re.search(r"is releasing by process (\d+), which is still running", done.stderr)
    if done.returncode == 3 and releasing:
        other = releasing.group(1)
        lv.wait_for("that release", lambda: not os.path.exists(f"/proc/{other}/cmdline"))
        done = lv.cli("restore", "--stranded")
    assert done.returncode == 0, done.stderr
    lv.wait_for("the holder to run again", lambda: lv.running() == {holder})
    lv.wait_for("only the holder's lease", lambda: list(lv.leases()) == [f"libvirt:{holder}"])
    status = lv.status()
    assert status["stranded"] == []
    assert status["tokens"]["gpu0"]["driver"] == "nvidia"


def test_libvirtd_restart_keeps_a_running_claimant_and_its_lease(lv: Libvirt) -> None:
    """Scenario 5: the reconnect hook exits 0, so libvirt keeps the VM."""
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", vm)
    pid = lv.qemu_pid(vm)
    before = lv.ledger_text()
    lv.stop_libvirtd()
    lv.start_daemons()
    assert lv.running() == {vm}
    assert lv.qemu_pid(vm) == pid
    assert lv.ledger_text() == before
    assert lv.leases()[f"libvirt:{vm}"]["state"] == "active"
    assert lv.status()["stranded"] == []


def test_parallel_starts_of_two_exclusive_claimants_one_wins(lv: Libvirt) -> None:
    """Scenario 6: both `virsh start` at once; exactly one runs, no deadlock."""
    names = [lv.define("race-a", EXCLUSIVE), lv.define("race-b", EXCLUSIVE)]
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    barrier = threading.Barrier(len(names))

    def start(name: str) -> None:
        barrier.wait()
        results[name] = lv.virsh("start", name, check=False, timeout=120)

    started = time.monotonic()
    threads = [threading.Thread(target=start, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    winners = [name for name in names if results[name].returncode == 0]
    assert len(winners) == 1, {n: r.stderr for n, r in results.items()}
    loser = next(name for name in names if name not in winners)
    assert "cannot claim gpu0" in results[loser].stderr
    assert lv.running() == set(winners)
    assert list(lv.leases()) == [f"libvirt:{winners[0]}"]
    assert elapsed < 60


def test_refuse_policy_names_the_vm_and_the_command(lv: Libvirt) -> None:
    """`libvirt_preemption = "refuse"`: the holder keeps running; the message says what to do."""
    lv.set_preemption("refuse")
    holder = lv.define("holder", SHARED_HOLDER)
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    refused = lv.virsh("start", vm, check=False)
    assert refused.returncode != 0
    assert f"libvirt:{holder}" in refused.stderr
    assert f"charly-arbiter acquire --exclusive libvirt:{vm} gpu0" in refused.stderr
    assert lv.running() == {holder}
    assert list(lv.leases()) == [f"libvirt:{holder}"]
    # The way out the message names: acquire outside any hook, then start.
    lv.cli("acquire", "--exclusive", f"libvirt:{vm}", "gpu0", check=True)
    assert lv.running() == set()
    lv.virsh("start", vm)
    assert lv.running() == {vm}
    lv.virsh("destroy", vm)
    lv.wait_for("the holder to run again", lambda: lv.running() == {holder})


@pytest.fixture(scope="module")
def holder_running(libvirt_session: Libvirt) -> tuple[Libvirt, str]:
    """One shared holder VM, running for all the bad-input cases."""
    libvirt_session.clean()
    holder = libvirt_session.define("holder", SHARED_HOLDER)
    libvirt_session.virsh("start", holder)
    return libvirt_session, holder


HOSTDEV_XML = b"""<domain type='qemu'><name>%s</name><devices><hostdev mode='subsystem'
 type='pci' managed='yes'><source><address domain='0x0000' bus='0x0a' slot='0x00'
 function='0x0'/></source></hostdev></devices></domain>"""
LAUGHS = b"""<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa">
<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]><domain><name>x</name><devices>
<hostdev type='pci'/></devices><description>&b;</description></domain>"""


@pytest.mark.parametrize(
    ("args", "stdin", "code", "message"),
    [
        pytest.param(
            ["qemu", "vm", "frobnicate", "begin", "-"], HOSTDEV_XML % b"vm", 0, "", id="unknown-op"
        ),
        pytest.param(
            ["qemu", "vm", "start", "begin", "-"], HOSTDEV_XML % b"vm", 0, "", id="start-op"
        ),
        pytest.param(
            ["lxc", "vm", "prepare", "begin", "-"], HOSTDEV_XML % b"vm", 0, "", id="other-driver"
        ),
        pytest.param(["qemu", "vm"], b"", 2, "usage", id="too-few-args"),
        pytest.param(
            ["qemu", "vm", "prepare", "begin", "-"],
            b"<domain><hostdev>",
            1,
            "not well-formed",
            id="malformed-prepare",
        ),
        pytest.param(
            ["qemu", "vm", "prepare", "begin", "-"], LAUGHS, 1, "DOCTYPE", id="entities-prepare"
        ),
        pytest.param(
            ["qemu", "vm", "prepare", "begin", "-"],
            b"<hostdev>" * 2_000_000,  # above the hook's 16 MiB bound
            1,
            "larger than",
            id="huge-prepare",
        ),
        pytest.param(
            ["qemu", "vm", "prepare", "begin", "-"],
            b"<domain><name>x</name></domain>",
            0,
            "",
            id="no-claim-prepare",
        ),
        pytest.param(
            ["qemu", "vm", "prepare", "begin", "-"],
            b"<domain><name>",
            0,
            "",
            id="truncated-no-hostdev",
        ),
        pytest.param(
            ["qemu", "a\nb", "prepare", "begin", "-"],
            HOSTDEV_XML % b"a",
            2,
            "control characters",
            id="newline-name",
        ),
        pytest.param(
            ["qemu", "x" * 1100, "prepare", "begin", "-"],
            HOSTDEV_XML % b"x",
            2,
            "1 to 1024",
            id="long-name",
        ),
        pytest.param(
            ["qemu", "{holder}", "release", "end", "-"],
            b"<domain><hostdev>",
            0,
            "not well-formed",
            id="malformed-release",
        ),
        pytest.param(
            ["qemu", "{holder}", "release", "end", "-"],
            LAUGHS,
            0,
            "DOCTYPE",
            id="entities-release",
        ),
        # A release the ledger does not name is let go before its XML is read: there
        # is nothing of the domain's to release (hook.py's fast path).
        pytest.param(
            ["qemu", "vm", "release", "end", "-"],
            b"<domain><hostdev>",
            0,
            "",
            id="malformed-release-of-a-domain-holding-nothing",
        ),
        pytest.param(
            ["qemu", "a\nb", "release", "end", "failed"],
            HOSTDEV_XML % b"a",
            0,
            "control",
            id="control-name-release",
        ),
        pytest.param(
            ["qemu", "vm", "reconnect", "begin", "-"],
            b"\xff\xfe garbage",
            0,
            "",
            id="garbage-reconnect",
        ),
        pytest.param(
            ["qemu", "vm", "reconnect", "begin", "-"],
            b"<hostdev",
            0,
            "not well-formed",
            id="malformed-reconnect",
        ),
        pytest.param(
            ["qemu", "vm", "migrate", "begin", "-"],
            HOSTDEV_XML % b"vm",
            3,
            "cannot migrate",
            id="migrate-exclusive",
        ),
        pytest.param(
            ["qemu", "vm", "prepare", "begin", "-"],
            HOSTDEV_XML.replace(b"0x0a", b"0x1ff") % b"vm",
            1,
            "bad address",
            id="bad-address",
        ),
    ],
)
def test_bad_input_to_the_hook(
    holder_running: tuple[Libvirt, str], args: list[str], stdin: bytes, code: int, message: str
) -> None:
    """Scenario 9: a clear message, the right exit code, nothing on stdout, ledger unchanged."""
    lv, holder = holder_running
    before = lv.ledger_text()
    result = lv.hook(*(arg.replace("{holder}", holder) for arg in args), stdin=stdin)
    assert result.returncode == code, result.stderr
    assert result.stdout == b""
    assert message.encode() in result.stderr
    if code:
        assert result.stderr.count(b"\n") <= 2, result.stderr
    assert lv.ledger_text() == before
    assert lv.running() == {holder}


def test_odd_guest_names_never_become_paths(lv: Libvirt) -> None:
    """A name full of shell syntax and dots is only ever `libvirt:NAME` in the ledger
    (libvirt refuses a '/' in a domain's name, and so does the arbiter: see below)."""
    odd = "..;$(touch ca-pwned) `id` 'x' \"y\" 虚拟机"
    xml = (
        f'<domain><name>x</name><metadata><ca:claim xmlns:ca="{"https://charly-arbiter.org/xmlns/claim/1"}"'
        ' mode="shared"><ca:token>gpu1</ca:token></ca:claim></metadata></domain>'
    ).encode()
    result = lv.hook("qemu", odd, "prepare", "begin", "-", stdin=xml)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b""
    assert list(lv.leases()) == [f"libvirt:{odd}"]
    assert not os.path.exists("ca-pwned") and not os.path.exists("/tmp/ca-pwned")
    result = lv.hook("qemu", odd, "release", "end", "-", stdin=xml)
    assert result.returncode == 0, result.stderr
    assert lv.leases() == {}
    # A name with a '/' is none libvirt can have: refused at prepare (exit 2, nothing
    # written), never a path; its release exits 0.
    slashed = "../../tmp/x"
    refused = lv.hook("qemu", slashed, "prepare", "begin", "-", stdin=xml)
    assert refused.returncode == 2 and b"cannot contain '/'" in refused.stderr
    assert lv.leases() == {}
    assert lv.hook("qemu", slashed, "release", "end", "-", stdin=xml).returncode == 0


def test_claim_set_with_virsh_metadata_is_read(lv: Libvirt) -> None:
    """The docs' `virsh metadata --set` command (libvirt namespaces only the root element)."""
    vm = lv.define("meta")
    lv.virsh(
        "metadata",
        vm,
        "https://charly-arbiter.org/xmlns/claim/1",
        "--key",
        "ca",
        "--config",
        "--set",
        '<claim mode="shared"><token>gpu1</token></claim>',
    )
    lv.virsh("start", vm)
    lease = lv.leases()[f"libvirt:{vm}"]
    assert (lease["mode"], lease["tokens"]) == ("shared", ["gpu1"])
    lv.virsh("destroy", vm)
    assert lv.leases() == {}


def managed_save(lv: Libvirt, name: str) -> str:
    info = lv.virsh("dominfo", name).stdout
    return info.split("Managed save:")[1].splitlines()[0].strip()


def test_managedsave_holder_is_saved_and_restored_from_its_image(lv: Libvirt) -> None:
    """A holder whose claim says stop="managedsave": saved, not shut down, and resumed."""
    holder = lv.define("saved", claim("shared", ("gpu0",), preemptible="yes", stop="managedsave"))
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", holder)
    lv.virsh("start", vm)
    assert lv.running() == {vm}
    assert managed_save(lv, holder) == "yes"
    lv.virsh("destroy", vm)
    lv.wait_for("the holder to run again", lambda: lv.running() == {holder})
    # libvirt reports the domain running a moment before it removes the image
    lv.wait_for("the managed save image to go", lambda: managed_save(lv, holder) == "no")
    lv.wait_for("its shared lease", lambda: list(lv.leases()) == [f"libvirt:{holder}"])


def test_vm_listed_in_the_configuration_is_a_holder_without_metadata(lv: Libvirt) -> None:
    """[[holders]] kind = "libvirt": a VM that uses the GPU without claiming it (no lease)."""
    plain = lv.define("listed")
    lv.set_preemption(
        "stop",
        f'\n[[holders]]\nkind = "libvirt"\nname = "{plain}"\ntokens = ["gpu0"]\n'
        "preemptible = true\n",
    )
    vm = lv.define("vm", EXCLUSIVE)
    lv.virsh("start", plain)
    assert lv.leases() == {}
    lv.virsh("start", vm)
    assert lv.running() == {vm}
    assert lv.leases()[f"libvirt:{vm}"]["stopped"] == [f"libvirt:{plain}"]
    lv.virsh("destroy", vm)
    lv.wait_for("the listed VM to run again", lambda: lv.running() == {plain})
    lv.wait_for("no lease", lambda: lv.leases() == {})


def test_release_records_the_shut_off_reason_of_newer_libvirt(lv: Libvirt) -> None:
    """libvirt >= 10.5 passes a reason to `release`; a stranded lease keeps it as its note."""
    vm = lv.define("reason", EXCLUSIVE)
    xml = lv.virsh("dumpxml", vm).stdout.encode()
    prepared = lv.hook("qemu", vm, "prepare", "begin", "-", stdin=xml)
    assert prepared.returncode == 0, prepared.stderr
    (lv.sim_dir / "host.toml").write_text(
        (lv.sim_dir / "host.toml")
        .read_text()
        .replace('address = "0000:0a:00.0"', 'address = "0000:0a:00.0"\nfail_switch = true', 1)
    )
    try:
        released = lv.hook("qemu", vm, "release", "end", "crashed", stdin=xml)
    finally:
        (lv.sim_dir / "host.toml").write_text(
            (lv.sim_dir / "host.toml").read_text().replace("\nfail_switch = true", "")
        )
    assert released.returncode == 0 and released.stdout == b""
    assert (f"libvirt:{vm}", "stopped (crashed)") in [
        (m.split(" ", 1)[0], m.split(" ", 1)[1]) for _, m in lv.hook_log_lines() if " " in m
    ]
    assert 'note = "crashed"' in lv.ledger_text()
    assert lv.status()["tokens"]["gpu0"]["poisoned"]
