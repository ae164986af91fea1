"""`plan` and `explain` say who uses a GPU's screen, in words and in --json, through
the real CLI on a simulated desktop (issue 19 item 2); `detect` is the local host's
(tests/host/test_screen.py)."""

from __future__ import annotations

import json

from simhosts import audio, gpu, holder, host, session

GPU1 = "0000:0b:00.0"
DESKTOP = host(
    gpu("0000:0a:00.0", group=12),
    audio("0000:0a:00.1", group=12),
    gpu(GPU1, group=13, model="2204", extra="boot_vga = true\nconsole = true"),
    holder("container", "llm", ["gpu0"], preemptible=True),
    holder("systemd", "display-manager.service", ["gpu1"], preemptible=True),
    session(GPU1, user_units=("pipewire.service",)),
)
SAID = (
    "gpu1 drives seat0: display-manager.service, the wayland session of alice, uid 1000 "
    "(session 2), the user units user@1000.service: pipewire.service; it is the boot display; "
    "the text console runs on it"
)


def release_screen(sim) -> None:
    config = sim.config_path.read_text().replace(
        f'address = "{GPU1}"', f'address = "{GPU1}"\nscreen = "release"'
    )
    sim.config_path.write_text(config)


def test_plan_refuses_naming_the_display_manager_the_session_and_the_user(make_sim):
    sim = make_sim(DESKTOP)
    said = sim.cli("plan", "--exclusive", "libvirt:win11", "gpu1")
    assert said.returncode == 3, said.stderr
    assert SAID in said.stdout
    assert 'hint: set `screen = "release"` for gpu1' in said.stdout
    document = json.loads(sim.cli("plan", "--json", "--exclusive", "libvirt:win11", "gpu1").stdout)
    assert document["screen"] == {
        "holder": "display-manager.service",
        "users": ["alice (uid 1000)"],
    }


def test_plan_with_release_shows_the_screen_it_takes(make_sim):
    sim = make_sim(DESKTOP)
    release_screen(sim)
    said = sim.cli("plan", "--exclusive", "libvirt:win11", "gpu1")
    assert said.returncode == 0, said.stdout + said.stderr
    assert f"It takes a screen: {SAID}." in said.stdout
    document = json.loads(sim.cli("plan", "--json", "--exclusive", "libvirt:win11", "gpu1").stdout)
    screen = document["screens"]["gpu1"]
    assert screen["display_manager"] == "display-manager.service"
    assert screen["sessions"][0] == {
        "id": "2",
        "seat": "seat0",
        "type": "wayland",
        "uid": 1000,
        "user": "alice",
        "leader": 900,
        "display_manager": "display-manager.service",
    }
    assert screen["text"] == SAID


def test_explain_says_who_uses_the_screen_and_what_a_claim_does_about_it(make_sim):
    sim = make_sim(DESKTOP)
    said = sim.cli("explain", "gpu1", check=True).stdout
    assert f"{SAID}." in said
    assert 'set screen = "release" for gpu1' in said
    release_screen(sim)
    said = sim.cli("explain", "gpu1", check=True).stdout
    assert 'With screen = "release", an exclusive claim stops them first' in said
    assert "drives" not in sim.cli("explain", "gpu0", check=True).stdout
