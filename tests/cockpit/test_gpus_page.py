"""The GPUs page in a real Cockpit, in real Chromium, over the real CLI on a simulated host.

What is real: cockpit-ws and cockpit-bridge (Debian's), Chromium through
chromedriver, the page's JavaScript, the CLI processes it spawns through the
bridge, and the ledger and history they write.  What stands in: the host
(`sim:DIR`), for the GPUs, drivers and holders these machines do not have.
Each scenario is scripted with the CLI, as an operator or a hook would, and
the page must show what the CLI says, in the CLI's words.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from cockpittools import OUTPUT, Browser, arbiter_config
from invariants import assert_invariants, sim_facts
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from simhosts import default_host

from charly_arbiter.core.ledger import Ledger

pytestmark = [pytest.mark.slow, pytest.mark.cockpit]

TOKEN_FUNCTIONS = {"gpu0": ["0000:0a:00.0", "0000:0a:00.1"], "gpu1": ["0000:0b:00.0"]}
# gpu1's switch fails (the stand-in for a bind that fails on a real host), and its
# display manager may be stopped, so that a claim on it gets as far as poisoning it.
HOST = default_host(gpu1="fail_switch = true", dm_preemptible=True)


def scripted_claims(sim) -> dict[str, str]:
    """A shared claim, an exclusive claim that preempts it, a refusal and a poisoning."""
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    refused = sim.cli("acquire", "--exclusive", "libvirt:other", "gpu0")
    assert refused.returncode == 3, refused.stderr
    poisoned = sim.cli("acquire", "--exclusive", "libvirt:lab", "gpu1")
    assert poisoned.returncode == 1, poisoned.stderr
    assert sim.status()["tokens"]["gpu1"]["poisoned"]
    return {"refused": refused.stderr, "poisoned": poisoned.stderr}


def need_superuser() -> None:
    """The actions run as Cockpit's superuser: a --local-session bridge has it as root
    (CI runs as root); as another user it would need sudo, which a test cannot answer."""
    if os.geteuid() != 0:
        pytest.skip("the page's actions need Cockpit's superuser: run as root (CI does)")


def first_render(browser: Browser) -> float:
    """Milliseconds from the page's navigation to its first status on screen."""
    value = browser.wait(
        lambda d: d.execute_script("return document.documentElement.dataset.firstRenderMs"),
        60,
        "the page's first render",
    )
    return float(value)


def record_load_time(name: str, shell_seconds: float, page_ms: float) -> None:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    line = f"{name}: shell frame {shell_seconds:.2f} s, page's first status {page_ms:.0f} ms\n"
    with (OUTPUT / "load-times.txt").open("a") as handle:
        handle.write(line)
    print(line, end="")


def facts(sim):
    return sim_facts(sim.host().snapshot(), TOKEN_FUNCTIONS, ["container:llm"])


def ledger_state(sim):
    return Ledger(sim.state_dir).read()


def test_the_page_shows_claims_refusals_poison_and_fixes_them(make_sim, cockpit_for, browser):
    need_superuser()
    sim = make_sim(host=HOST)
    scripted_claims(sim)
    status = sim.status()
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    shell_seconds = browser.open_page(cockpit)
    page_ms = first_render(browser)
    record_load_time("1280x800, 2 GPUs, 11 events", shell_seconds, page_ms)
    assert page_ms < 20000

    # gpu0: exclusive, held by win11 since its lease's time, what was stopped for it
    card = browser.wait_text("#token-gpu0", "Exclusive")
    assert "libvirt:win11 (exclusive, active) since" in card
    stopped = status["leases"][0]["stopped"]
    assert sorted(stopped) == ["container:llm", "systemd:ollama.service"]
    assert f"Stopped for it\n{stopped[0]} and {stopped[1]}" in card
    assert "0000:0a:00.1 vfio-pci" in card
    # gpu1: poisoned, with the reason the CLI recorded, and the fix in words
    alert = browser.wait_text("#alert-poisoned-gpu1", "gpu1 is poisoned")
    reason = status["tokens"]["gpu1"]["reason"]
    assert reason and reason in alert
    assert "lspci -nnk -s 0000:0b:00.0" in alert
    # the history: the refusal and the poisoning, in the CLI's words, listed and marked
    history = json.loads(sim.cli("history", "--json").stdout)
    refusal = next(event for event in history if event["event"] == "refused")
    assert refusal["claimant"] == "libvirt:other"
    events = browser.wait_text("#events", refusal["message"])
    assert "poisoned" in events
    browser.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline .ca-mark-refused"))
    assert browser.driver.find_elements(By.CSS_SELECTOR, "#timeline .ca-mark-poisoned")
    assert browser.driver.find_elements(By.CSS_SELECTOR, "#timeline .ca-bar-exclusive")
    assert browser.driver.find_elements(By.CSS_SELECTOR, "#timeline .ca-bar-stopped")
    assert f"ledger generation {status['generation']}" in browser.text("#summary")
    browser.screenshot("gpus-1280x800")
    browser.driver.execute_script("document.getElementById('history').scrollIntoView()")
    browser.screenshot("gpus-history-1280x800")
    browser.driver.execute_script("window.scrollTo(0, 0)")

    # Live: the VM dies; no file changes, the follower's periodic look finds it stranded.
    sim.stopped("libvirt:win11")
    alert = browser.wait_text("#alert-stranded-libvirt_win11", "libvirt:win11 is stranded", 40)
    assert "libvirt:win11 is not running any more" in alert
    browser.screenshot("gpus-stranded")
    browser.viewport(1280, 1330)  # the whole page at once, for docs/cockpit-gpus.png
    browser.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline .ca-mark-refused"))
    browser.screenshot("gpus-whole-page-1280")
    browser.viewport(1280, 800)

    # Restore from the page: the plan first, then the restore; the ledger shows it.
    generation = status["generation"]
    browser.click("#restore-libvirt_win11")
    plan = browser.wait_text("#dialog-body", "container:llm")
    assert "systemd:ollama.service" in plan
    assert "send gpu0 home" in plan
    assert sim.status()["generation"] == generation  # the confirmation changed nothing
    browser.screenshot("gpus-restore-confirmation")
    browser.click("#dialog-confirm")
    browser.wait_text("#notice", "Restored libvirt:win11.")
    state = ledger_state(sim)
    assert state.lease_of("libvirt:win11") is None
    assert sim.host().snapshot()["drivers"]["0000:0a:00.0"] == "nvidia"
    assert_invariants(state, facts(sim), "after the page's restore")
    browser.wait(lambda d: not d.find_elements(By.ID, "alert-stranded-libvirt_win11"))
    # container:llm, preempted as a shared claimant, has its shared lease back
    browser.wait_text("#token-gpu0", "container:llm (shared, active)")

    # Clear the poison from the page: the reason and drivers first, then the clear.
    browser.click("#clear-gpu1")
    confirmation = browser.wait_text("#dialog-body", reason)
    assert "0000:0b:00.0 on nvidia" in confirmation
    browser.click("#dialog-confirm")
    browser.wait_text("#notice", "Cleared the poison of gpu1.")
    assert ledger_state(sim).poison_of("gpu1") is None
    assert json.loads(sim.cli("poison", "list", "--json").stdout) == []
    browser.wait(lambda d: not d.find_elements(By.ID, "alert-poisoned-gpu1"))
    browser.wait_text("#events", "the poison of gpu1 was cleared")
    assert_invariants(ledger_state(sim), facts(sim), "after the page's clear")
    browser.screenshot("gpus-after-fixes")


def test_an_action_that_fails_shows_the_cli_sentences(make_sim, cockpit_for, browser):
    """A restore the CLI refuses (the claimant runs again) shows the CLI's own words."""
    need_superuser()
    sim = make_sim(host=HOST)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.cli("acquire", "--exclusive", "libvirt:lab", "gpu1")
    sim.stopped("libvirt:win11")
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    browser.wait_text("#alert-stranded-libvirt_win11", "is stranded")
    browser.click("#restore-libvirt_win11")
    browser.wait(lambda d: d.find_element(By.ID, "dialog-confirm").is_enabled())
    # Meanwhile the VM is started again by someone else: restoring it is refused.
    sim.host().set_running("libvirt:win11", True)
    cli = sim.cli("restore", "--dry-run", "libvirt:win11")
    assert cli.returncode == 3, cli.stderr
    words = [line.removeprefix("charly-arbiter: ") for line in cli.stderr.strip().splitlines()]
    browser.click("#dialog-confirm")
    error = browser.wait_text("#dialog-error", "Refused")
    assert words[-2] in error, (words, error)
    assert words[-1].replace("hint: ", "Hint: ") in error
    assert ledger_state(sim).lease_of("libvirt:win11") is not None
    browser.driver.find_element(By.ID, "dialog-cancel").click()


def test_preview_of_a_vm_start_by_keyboard(make_sim, cockpit_for, browser):
    sim = make_sim(host=default_host())
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    generation = sim.status()["generation"]
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    browser.wait_text("#token-gpu0", "Shared")
    driver = browser.driver
    driver.execute_script("document.getElementById('preview').focus()")
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    browser.wait(lambda d: d.switch_to.active_element.get_attribute("id") == "plan-domain")
    # First as its definition says: this simulated host has no libvirt to read it from
    # (it never asks this machine's), and the page says so in the CLI's words.
    expected = sim.cli("plan", "--json", "libvirt:win11")
    assert expected.returncode == 2
    words = [line.removeprefix("charly-arbiter: ") for line in expected.stderr.splitlines()]
    driver.switch_to.active_element.send_keys("win11", Keys.ENTER)
    # (the page writes the CLI's "hint:" as "Hint:"; with a libvirtd running the CLI's
    # last line is its hint, without one it is the error itself)
    last = words[-1].replace("hint: ", "Hint: ") if words else "?"
    error = browser.wait_text("#dialog-error", last)
    assert all(line.replace("hint: ", "Hint: ") in error for line in words[-2:]), (words, error)
    # Then as an exclusive claim of gpu0, chosen by keyboard.
    driver.find_element(By.CSS_SELECTOR, "input[name=plan-mode][value=exclusive]").send_keys(
        Keys.SPACE
    )
    driver.find_element(By.ID, "plan-domain").send_keys(Keys.ENTER)
    plan = browser.wait_text("#plan-result", "Claiming gpu0 (exclusive): libvirt:win11 can claim")
    assert "container:llm (stop" in plan
    assert "0000:0a:00.1" in plan and "snd_hda_intel" in plan
    # (ollama, on the home driver, ran beside llm's shared use: the claim stops it too.)
    assert (
        "When win11 stops, systemd:ollama.service and container:llm would be started again." in plan
    )
    browser.screenshot("gpus-plan-preview")
    # gpu1's display manager is not preemptible: the refusal, as `plan --json` says it.
    expected = json.loads(sim.cli("plan", "--json", "--exclusive", "libvirt:win11", "gpu1").stdout)
    driver.find_element(By.CSS_SELECTOR, "input[name=plan-token][value=gpu0]").send_keys(Keys.SPACE)
    driver.find_element(By.CSS_SELECTOR, "input[name=plan-token][value=gpu1]").send_keys(Keys.SPACE)
    driver.find_element(By.ID, "plan-domain").send_keys(Keys.ENTER)
    refused = browser.wait_text("#plan-result", "would be refused")
    assert expected["refused"] in refused
    assert f"Hint: {expected['hint']}" in refused
    driver.switch_to.active_element.send_keys(Keys.ESCAPE)
    browser.wait(lambda d: not d.find_element(By.ID, "dialog").get_attribute("open"))
    assert driver.switch_to.active_element.get_attribute("id") == "preview"
    assert sim.status()["generation"] == generation  # a preview writes nothing


def test_a_phone_sees_the_same_without_scrolling_sideways(make_sim, cockpit_for, browser):
    sim = make_sim(host=HOST)
    scripted_claims(sim)
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(390, 844, mobile=True)
    try:
        shell_seconds = browser.open_page(cockpit)
        page_ms = first_render(browser)
        record_load_time("390x844 (phone)", shell_seconds, page_ms)
        browser.wait_text("#token-gpu0", "libvirt:win11")
        browser.wait(lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline svg"))
        widths = browser.driver.execute_script(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )
        assert widths[0] <= widths[1], f"the page scrolls sideways: {widths}"
        browser.screenshot("gpus-phone")
    finally:
        browser.viewport(1280, 800)


def test_without_the_arbiter_the_page_says_what_to_install(cockpit_for, browser):
    # The shipped manifest runs `charly-arbiter` from PATH, where there is none here.
    cockpit = cockpit_for(None)
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    problem = browser.wait_text("#problem", "charly-arbiter is not installed")
    assert "Install the charly-arbiter package" in problem
    assert browser.driver.find_element(By.ID, "preview").get_attribute("disabled") is not None
    browser.screenshot("gpus-not-installed")


def test_a_damaged_ledger_is_shown_and_nothing_can_be_changed(make_sim, cockpit_for, browser):
    sim = make_sim(host=HOST)
    scripted_claims(sim)
    ledger = sim.state_dir / "ledger.toml"
    damaged = bytearray(ledger.read_bytes())
    damaged[-2] ^= 0x01  # one bit of the last lease or poison record
    ledger.write_bytes(bytes(damaged))
    said = sim.cli("status", "--json")
    assert said.returncode == 1
    corrupt = json.loads(said.stdout)["corrupt"]
    assert corrupt
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    alert = browser.wait_text("#alert-corrupt", "The ledger is damaged")
    assert corrupt in alert
    assert "charly-arbiter recover" in alert
    assert browser.driver.find_element(By.ID, "preview").get_attribute("disabled") is not None
    for button in browser.driver.find_elements(By.CSS_SELECTOR, "#alerts button"):
        assert not button.is_enabled(), button.text
    card = browser.wait_text("#token-gpu0", "Unknown")
    assert "Unknown: the ledger is damaged" in card  # never "Nobody": it cannot know
    assert "ledger damaged" in browser.text("#summary")
    # The history is its own file: what happened before the damage is still there.
    browser.wait_text("#events", "libvirt:other was refused gpu0")
    browser.screenshot("gpus-damaged-ledger")


def test_the_first_status_then_changes_arrive_without_a_reload(make_sim, cockpit_for, browser):
    """The first status is the CLI's, and what the CLI changes afterwards reaches the open
    page by its one follower: a claim, then a ledger damaged in place (cards "Unknown",
    every action disabled).  The bounds only keep a broken page from hanging the test;
    bench/bench_page.py measures how fast it is."""
    sim = make_sim(host=default_host())
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    status = sim.status()
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    first_render(browser)
    # The first status on screen is the one `status --json` gives.
    summary = browser.text("#summary")
    assert summary == f"2 GPUs \u00b7 1 lease \u00b7 ledger generation {status['generation']}"
    assert "container:llm (shared, active) since" in browser.text("#token-gpu0")
    assert "Shared" in browser.text("#token-gpu0")
    assert "Nobody" in browser.text("#token-gpu1")
    driver = browser.driver
    driver.execute_script("window.charlyLoadedOnce = true")
    (follower,) = browser.wait(lambda d: _followers(sim.config_path), 10, "the follower")

    # A claim made by the CLI: on screen, in the same page, by the same follower.
    sim.cli("acquire", "--shared", "container:batch", "gpu1", check=True)
    generation = sim.status()["generation"]
    browser.wait_text("#token-gpu1", "container:batch (shared, active)", 10)
    browser.wait_text("#summary", f"ledger generation {generation}", 10)
    browser.wait_text("#events", "container:batch", 10)
    assert driver.execute_script("return window.charlyLoadedOnce === true"), "the page reloaded"
    assert _followers(sim.config_path) == [follower], "a new follower for a change"

    # The ledger damaged in place (no rename): the page says so, and allows nothing.
    ledger = sim.state_dir / "ledger.toml"
    damaged = bytearray(ledger.read_bytes())
    damaged[-2] ^= 0x01
    ledger.write_bytes(bytes(damaged))
    alert = browser.wait_text("#alert-corrupt", "The ledger is damaged", 10)
    assert json.loads(sim.cli("status", "--json").stdout)["corrupt"] in alert
    browser.wait_text("#token-gpu0", "Unknown: the ledger is damaged", 10)
    assert browser.driver.find_element(By.ID, "preview").get_attribute("disabled") is not None
    for button in browser.driver.find_elements(By.CSS_SELECTOR, "#alerts button"):
        assert not button.is_enabled(), button.text
    assert driver.execute_script("return window.charlyLoadedOnce === true"), "the page reloaded"


def test_the_follower_ends_with_the_page(make_sim, cockpit_for, browser):
    """Closing the page ends its `status --follow`; while open and idle it asks nothing."""
    sim = make_sim(host=default_host())
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    first_render(browser)
    browser.wait_text("#token-gpu0", "Idle")
    followers = browser.wait(lambda d: _followers(sim.config_path), 20, "a follower process")
    asked = "return document.documentElement.dataset.historyRequests"
    requests = browser.wait(lambda d: d.execute_script(asked), 20, "the first history")
    time.sleep(3)
    assert browser.driver.execute_script(asked) == requests, "history fetched, nothing changed"
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    browser.wait_text("#token-gpu0", "Shared")
    browser.driver.switch_to.default_content()
    browser.driver.get("about:blank")
    deadline = time.monotonic() + 20
    while _followers(sim.config_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _followers(sim.config_path), f"still following after the page closed: {followers}"


def test_a_killed_follower_is_started_again(make_sim, cockpit_for, browser):
    """kill -9 of the page's `status --follow`: the page says so and follows again."""
    sim = make_sim(host=default_host())
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.open_page(cockpit)
    browser.wait_text("#token-gpu0", "Idle")
    (first,) = browser.wait(lambda d: _followers(sim.config_path), 20, "a follower process")
    os.kill(first, signal.SIGKILL)
    browser.wait_text("#problem", "Lost contact with charly-arbiter", 20)
    assert "Idle" in browser.text("#token-gpu0"), "the last state stays on screen"
    again = browser.wait(
        lambda d: [pid for pid in _followers(sim.config_path) if pid != first], 30, "a new one"
    )
    assert again
    browser.wait(lambda d: not d.find_element(By.ID, "problem").is_displayed(), 20, "recovered")
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    browser.wait_text("#token-gpu0", "Shared")


def _followers(config_path: Path) -> list[int]:
    """Pids of `status --json --follow` processes whose environment names this test's config."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--follow" in argv and f"CHARLY_ARBITER_CONFIG={config_path}".encode() in environ:
            found.append(int(entry.name))
    return found


def test_the_timeline_follows_the_events(cockpit_for, browser):
    """timeline.js's model of a history, computed by the page's own module in Chromium:
    bars from claim to release, a preempted shared claimant stopped then back, marks
    for a refusal and a failed claim, and a restore that is no failure."""
    cockpit = cockpit_for(None)
    browser.open_page(cockpit)
    browser.wait_text("#problem", "not installed")

    def at(second: int) -> str:
        return f"2026-12-01T10:00:{second:02d}.000+00:00"

    events = [
        {
            "time": at(0),
            "event": "claim",
            "claimant": "container:llm",
            "token": "gpu0",
            "mode": "shared",
        },
        {
            "time": at(1),
            "event": "active",
            "claimant": "container:llm",
            "token": "gpu0",
            "mode": "shared",
        },
        {
            "time": at(10),
            "event": "claim",
            "claimant": "libvirt:vm",
            "token": "gpu0",
            "mode": "exclusive",
        },
        {"time": at(11), "event": "preempted", "claimant": "libvirt:vm", "holder": "container:llm"},
        {
            "time": at(15),
            "event": "refused",
            "claimant": "libvirt:other",
            "token": "gpu0",
            "why": "held",
        },
        {
            "time": at(20),
            "event": "claim",
            "claimant": "libvirt:bad",
            "token": "gpu1",
            "mode": "exclusive",
        },
        {
            "time": at(21),
            "event": "poisoned",
            "claimant": "libvirt:bad",
            "token": "gpu1",
            "why": "x",
        },
        {"time": at(22), "event": "failed", "claimant": "libvirt:bad", "why": "switch failed"},
        {"time": at(30), "event": "restore", "claimant": "libvirt:vm"},
        {"time": at(31), "event": "restored", "claimant": "libvirt:vm", "holder": "container:llm"},
        {"time": at(32), "event": "failed", "claimant": "libvirt:vm", "why": "restored"},
    ]
    now = browser.driver.execute_script("return new Date(arguments[0]).getTime() / 1000", at(40))
    model = browser.driver.execute_async_script(
        "const [events, now, done] = arguments;"
        "import('./timeline.js').then(m => done(m.buildTimeline(events, now)));",
        events,
        now,
    )
    lanes = {lane["name"]: lane for lane in model["lanes"]}
    assert list(lanes) == ["container:llm", "libvirt:vm", "libvirt:other", "libvirt:bad"]

    def spans(name: str) -> list[tuple[str, float, float, bool]]:
        return [
            (bar["kind"], bar["start"] - now, bar["end"] - now, bool(bar.get("ongoing")))
            for bar in lanes[name]["bars"]
        ]

    assert spans("container:llm") == [
        ("shared", -40, -29, False),
        ("stopped", -29, -9, False),
        ("shared", -9, 0, True),  # its shared lease came back with the restore
    ]
    assert spans("libvirt:vm") == [("exclusive", -30, -10, False)]
    assert [mark["kind"] for mark in lanes["libvirt:vm"]["marks"]] == []  # a restore is no failure
    assert [mark["kind"] for mark in lanes["libvirt:other"]["marks"]] == ["refused"]
    assert spans("libvirt:bad") == [("exclusive", -20, -18, False)]
    assert [mark["kind"] for mark in lanes["libvirt:bad"]["marks"]] == ["poisoned", "failed"]
    assert model["start"] < now - 40 and model["end"] > now


def test_the_page_says_whether_sleep_is_blocked_while_a_gpu_is_passed_through(
    make_sim, cockpit_for, browser
):
    """A VM's lock on the card in the CLI's words; a lock the host could not take (no
    systemd) as a warning with what to do; gone once the VM's GPU comes home."""
    sim = make_sim(host=default_host())
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    why = sim.status()["tokens"]["gpu0"]["sleep_blocked"]
    assert why == "gpu0 is passed through to libvirt:win11"
    cockpit = cockpit_for(arbiter_config(sim.config_path))
    browser.viewport(1280, 800)
    browser.open_page(cockpit)
    card = browser.wait_text("#token-gpu0", f"Sleep blocked while {why}")
    assert "Sleep" in card
    assert not browser.driver.find_elements(By.ID, "sleep-gpu1")
    browser.screenshot("gpus-sleep-blocked")

    # The lock is stopped from outside and the host cannot take it again (no systemd).
    sim.set_host("systemd = false\n" + (sim.sim_dir / "host.toml").read_text())
    sim.host().uninhibit("gpu0")
    alert = browser.wait_text(
        "#alert-sleep-gpu0", "Sleep is not blocked while gpu0 is passed through", 40
    )
    assert "systemd is not running here" in alert
    assert "charly-arbiter restore --stranded" in alert
    browser.wait_text("#sleep-gpu0", "Not blocked")

    sim.stopped("libvirt:win11")
    sim.cli("release", "libvirt:win11", check=True)
    browser.wait(lambda d: not d.find_elements(By.ID, "sleep-gpu0"), 40)
    assert not browser.driver.find_elements(By.ID, "alert-sleep-gpu0")
