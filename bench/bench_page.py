"""The GPUs page in Cockpit: how long people wait for it, and where the time goes.

What runs is what the page's tests run (tests/cockpit/cockpittools.py): a real
cockpit-ws and cockpit-bridge, headless Chromium through Debian's selenium, the
page's own files and this checkout's CLI on Debian's python3 against a
simulated host with two GPUs and a lease.  Each run opens the page afresh, then
makes two changes in the ledger with the real CLI (a shared claim, then its
release) while it is open.

Figures (medians over the runs, with the range), read from the browser:
- **first status**: from the page's frame starting to load (its Navigation
  Timing `fetchStart`) to the `performance.mark` the page sets when its first
  status is rendered; twice: the page's URL opened (the shell loads beside it,
  with the Overview and Services pages it preloads, on the same renderer
  thread) and "GPUs" clicked in the menu of a shell left to settle (how an
  operator usually arrives);
- **a change on screen**: from the ledger's write (its mtime, the CLI's last
  write of the claim) to the mark the page sets when that generation is
  rendered (`performance.timeOrigin` + the mark, both wall clock of this
  machine); and to the history list showing it;
- **the breakdown** of the first status: the frame's HTML, cockpit.js
  (Resource Timing), the page's modules evaluated, its configuration read, the
  CLI's first output after the spawn through the bridge, the rendering;
  and, measured beside it with the same interpreter, what one `status --json`
  costs on its own: the interpreter (`python3 -c pass`, the baseline of the
  ratios), its imports (`-X importtime`, by top-level package) and the work
  (in-process, after the imports; `--profile` prints where it goes).

The page runs the program as the package installs it (packaging/launcher.py,
pointed at the checkout), two ways, each in a Cockpit of its own: in-process
(CHARLY_ARBITER_SERVE=off) and through the resident helper (`charly-arbiter
serve` started by hand on a socket of the run's own, CHARLY_ARBITER_SERVE=must:
a follower that did not run there fails the run), as a host with the package's
socket unit runs it.

Not a timed test: the figures depend on the machine (print `uptime` with them).

Run: /usr/bin/python3 bench/bench_page.py [--runs N] [--repo DIR] [--profile]
     [--way in-process|helper|both]
(`--repo` measures another checkout's page and CLI, e.g. an export of main.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "cockpit"))

sys.path.insert(0, str(REPO / "packaging"))

from cockpittools import (  # noqa: E402
    COCKPIT_LOCK,
    PYTHON,
    Browser,
    Cockpit,
    arbiter_config,
    start_chromium,
    start_cockpit,
)
from launcher import write_launcher  # noqa: E402
from machine import flocked  # noqa: E402

SPAN = "charly-arbiter:"
FIRST_STATUS = SPAN + "first-status"
SETTLE = 3.0  # seconds a shell is left to load what it preloads before "GPUs" is clicked

# Read inside the page's frame: its navigation, what it loaded, and its marks
# (times in ms since the frame's navigation began; detail as the page set it).
TIMINGS = """
const nav = performance.getEntriesByType("navigation")[0] || {};
const resources = performance.getEntriesByType("resource").map(r => (
    {name: r.name, start: r.startTime, end: r.responseEnd}));
const marks = performance.getEntriesByType("mark").filter(m => m.name.startsWith("charly-arbiter:"))
    .map(m => ({name: m.name, at: m.startTime, detail: m.detail}));
return {origin: performance.timeOrigin, fetchStart: nav.fetchStart, htmlEnd: nav.responseEnd,
        interactive: nav.domInteractive, resources, marks};
"""


def median_ms(action: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


class Host:
    """A simulated host (`sim init`: two GPUs) with one shared lease, and the CLI of `repo`."""

    def __init__(self, root: Path, repo: Path) -> None:
        self.repo = repo
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
        self.env["PYTHONPATH"] = str(repo)
        self.cli("sim", "init", str(root / "sim"))
        self.config = root / "sim" / "arbiter.toml"
        self.env["CHARLY_ARBITER_CONFIG"] = str(self.config)
        self.ledger = root / "sim" / "state" / "ledger.toml"
        self.cli("acquire", "--shared", "container:llm", "gpu0")

    def argv(self, *args: str) -> list[str]:
        return [PYTHON, "-m", "charly_arbiter", *args]

    def program(self, root: Path) -> Path:
        """The program as the package installs it, pointed at `repo`."""
        launcher = root / "bin" / "charly-arbiter"
        write_launcher(launcher, PYTHON, str(self.repo))
        return launcher

    def cli(self, *args: str) -> str:
        done = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"charly-arbiter {' '.join(args)}: {done.returncode}\n{done.stderr}")
        return done.stdout


class Helper:
    """`charly-arbiter serve` on a socket of this run, until `stop`."""

    def __init__(self, host: Host, program: Path, socket: Path) -> None:
        self.socket = socket
        self.process = subprocess.Popen(
            [str(program), "serve", "--socket", str(socket)],
            env=host.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        environ = {**host.env, **dict(e.split("=", 1) for e in self.environ())}
        wait(
            lambda: (
                subprocess.run(
                    [str(program), "--version"], env=environ, capture_output=True
                ).returncode
                == 0
            ),
            60,
            "the resident helper",
        )

    def environ(self) -> list[str]:
        return [
            f"CHARLY_ARBITER_SOCKET={self.socket}",
            "CHARLY_ARBITER_SERVE=must",
            "CHARLY_ARBITER_SERVE_DEADLINE_MS=2000",  # a row measures, never falls back
        ]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.02)
    raise SystemExit(f"timed out after {timeout} s: {what}")


def timings(browser: Browser) -> dict[str, Any]:
    return dict(browser.driver.execute_script(TIMINGS))


def marks(found: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [mark for mark in found["marks"] if mark["name"] == name]


def open_from_the_menu(browser: Browser, cockpit: Cockpit) -> None:
    """The shell first (its Overview, with the pages it preloads), left to settle, then
    "GPUs" clicked in its menu: the page loads in a shell that is not busy loading."""
    from selenium.webdriver.common.by import By

    driver = browser.driver
    driver.switch_to.default_content()
    driver.get(f"{cockpit.url}/system")
    link = wait(
        lambda: next(iter(driver.find_elements(By.CSS_SELECTOR, "a[href='/charly-arbiter']")), 0),
        60,
        "the shell's menu",
    )
    time.sleep(SETTLE)
    link.click()
    browser.enter_page()
    wait(lambda: browser.driver.execute_script("return document.readyState"), 30, "the frame")


def first_load(browser: Browser, cockpit: Cockpit, menu: bool) -> dict[str, float]:
    """Open the page afresh (by its URL, the shell loading too, or from the menu of a
    settled shell); the phases of its first status, in ms from fetchStart."""
    if menu:
        open_from_the_menu(browser, cockpit)
    else:
        browser.open_page(cockpit)
    found = wait(
        lambda: (t := timings(browser)) and marks(t, FIRST_STATUS) and t, 60, "the first status"
    )
    start = found["fetchStart"]

    def at(name: str) -> float:
        return float(marks(found, SPAN + name)[0]["at"]) - start

    cockpit_js = next(r for r in found["resources"] if r["name"].endswith("/base1/cockpit.js"))
    return {
        "the frame's HTML": found["htmlEnd"] - start,
        "cockpit.js loaded": cockpit_js["end"] - start,
        "the page's modules running": at("script"),
        "its configuration read": at("config"),
        "the follower spawned": at("spawn"),
        "its first output": at("first-output"),
        "first status on screen": at("first-status"),
    }


def change(browser: Browser, host: Host, args: Sequence[str]) -> tuple[float, float]:
    """Make a change with the CLI; ms from the ledger's write to the page showing that
    generation, and to its history being rendered again after it."""
    before = timings(browser)
    seen_history = len(marks(before, SPAN + "history"))
    host.cli(*args)
    written = host.ledger.stat().st_mtime_ns / 1e6  # the claim's last write, epoch ms
    generation = int(host.cli("status", "--json").split('"generation": ')[1].split(",")[0])

    def shown() -> dict[str, Any] | None:
        found = timings(browser)
        rendered = [
            m
            for m in marks(found, SPAN + "status")
            if (m["detail"] or {}).get("generation") == generation
        ]
        histories = marks(found, SPAN + "history")[seen_history:]
        if rendered and histories and histories[-1]["at"] >= rendered[0]["at"]:
            return {"status": rendered[0]["at"], "history": histories[-1]["at"], **found}
        return None

    found = wait(shown, 30, f"generation {generation} and its history on screen")
    return (
        found["origin"] + found["status"] - written,
        found["origin"] + found["history"] - written,
    )


def importtime(host: Host, runs: int) -> dict[str, float]:
    """`status --json`'s imports in ms: each module's own time (`-X importtime`'s
    "self"), summed by where it comes from; medians of `runs`."""
    own = {"charly_arbiter": "the package's own modules", "click": "click"}
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        done = subprocess.run(
            [PYTHON, "-X", "importtime", *host.argv("status", "--json")[1:]],
            env=host.env,
            capture_output=True,
            text=True,
        )
        groups = dict.fromkeys([*own.values(), "the standard library and the rest"], 0.0)
        for line in done.stderr.splitlines():
            if not line.startswith("import time:") or "cumulative" in line:
                continue
            self_us, _, name = line.removeprefix("import time:").split("|")
            group = own.get(name.strip().split(".")[0], "the standard library and the rest")
            groups[group] += int(self_us) / 1000
        for group, ms in groups.items():
            samples.setdefault(group, []).append(ms)
    return {group: statistics.median(values) for group, values in samples.items()}


BRIDGE_SPAWN = """
const [argv, environ, done] = arguments;
const started = performance.now();
cockpit.spawn(argv, {environ}).then(() => done(performance.now() - started), e => done(-1));
"""


def bridge_ms(browser: Browser, argv: list[str], environ: Sequence[str] = ()) -> float:
    """A spawn through cockpit-bridge, from the page to the process's end, in ms."""
    took = float(browser.driver.execute_async_script(BRIDGE_SPAWN, argv, list(environ)))
    if took < 0:
        raise SystemExit(f"{argv} failed through the bridge")
    return took


def work_ms(host: Host, runs: int, profile: bool) -> float:
    """One `status --json`'s work in this process (imports done): the arbiter's status
    and its JSON, as the follower does it for each document."""
    for key in ("PYTHONPATH", "CHARLY_ARBITER_CONFIG"):
        os.environ[key] = host.env[key]
    sys.path.insert(0, str(host.repo))
    import json

    from charly_arbiter.cli.app import App
    from charly_arbiter.cli.status import status_document

    app = App(config_path=None, state_dir=None, host_spec=None, verbose=0)
    arbiter = app.arbiter()

    def one() -> str:
        return json.dumps(status_document(arbiter.status()), sort_keys=True)

    one()
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [one() for _ in range(runs)])
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(14)
        print(out.getvalue())
    return median_ms(one, runs)


def summary(samples: Sequence[float]) -> str:
    return f"{statistics.median(samples):7.0f} ms  ({min(samples):.0f}-{max(samples):.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout measured")
    parser.add_argument("--profile", action="store_true", help="print the work's profile")
    parser.add_argument("--way", choices=("in-process", "helper", "both"), default="both")
    args = parser.parse_args()
    ways = [args.way == "helper"] if args.way != "both" else [False, True]
    with flocked(COCKPIT_LOCK, "a Cockpit test session (tests/cockpit)") as waited:
        if waited > 1:
            print(f"waited {waited:.0f} s for {COCKPIT_LOCK}", file=sys.stderr)
        for served in ways:
            measure(args.repo.resolve(), args.runs, args.profile, served)
        return 0


def measure(repo: Path, runs: int, profile: bool, served: bool) -> None:
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="charly-bench-page-") as directory:
        root = Path(directory)
        host = Host(root, repo)
        base = median_ms(lambda: subprocess.run([PYTHON, "-c", "pass"], check=True), runs)
        alone = median_ms(lambda: host.cli("status", "--json"), runs)
        imports = importtime(host, 3)
        work = work_ms(host, runs * 3, profile)
        program = host.program(root)
        config = arbiter_config(host.config, command=[str(program)], repo=repo)
        helper = Helper(host, program, root / "serve.sock") if served else None
        config["environ"] += helper.environ() if helper else ["CHARLY_ARBITER_SERVE=off"]
        cockpit = start_cockpit(root / "cockpit", config, repo / "cockpit")
        driver = start_chromium(root / "chromium")
        browser = Browser(driver)
        loads: list[dict[str, float]] = []
        menu_loads: list[dict[str, float]] = []
        spawns: dict[str, list[float]] = {
            "/bin/true": [],
            "python3 -c pass": [],
            "status --json": [],
        }
        shown: list[float] = []
        history: list[float] = []
        try:
            browser.viewport(1280, 800)
            for _ in range(runs):
                menu_loads.append(first_load(browser, cockpit, menu=True))
                loads.append(first_load(browser, cockpit, menu=False))
                time.sleep(1.5)  # its history fetched, the page idle
                spawns["/bin/true"].append(bridge_ms(browser, ["/bin/true"]))
                spawns["python3 -c pass"].append(bridge_ms(browser, [PYTHON, "-c", "pass"]))
                spawns["status --json"].append(
                    bridge_ms(browser, [str(program), "status", "--json"], config["environ"])
                )
                for change_args in (
                    ("acquire", "--shared", "container:bench", "gpu1"),
                    ("release", "--force", "container:bench"),
                ):
                    status_ms, history_ms = change(browser, host, change_args)
                    shown.append(status_ms)
                    history.append(history_ms)
                    time.sleep(1.0)
        finally:
            driver.quit()
            cockpit.stop()
            if helper is not None:
                helper.stop()
            shutil.rmtree(root / "chromium", ignore_errors=True)
    after = os.getloadavg()
    way = "through the resident helper" if served else "in-process"
    print(
        f"the GPUs page of {repo}, its CLI {way}, {runs} runs (load average "
        f"{load[0]:.2f} before, {after[0]:.2f} after)"
    )
    through_bridge = statistics.median(spawns["status --json"])
    for title, opened in (
        ("the URL opened", loads),
        ("GPUs clicked in a settled shell", menu_loads),
    ):
        print(f"{title}: first status, ms after the frame starts loading (median, range):")
        for phase in opened[0]:
            print(f"  {phase:<36} {summary([run[phase] for run in opened])}")
        first = statistics.median(run["first status on screen"] for run in opened)
        print(f"  {'  / one status --json by the bridge':<36} {first / through_bridge:7.1f}x")
    print("a change in the ledger (the CLI's write), ms until the page shows it:")
    print(f"  {'its status on screen':<36} {summary(shown)}")
    print(f"  {'its history on screen':<36} {summary(history)}")
    print("a spawn through cockpit-bridge from the open page, until the process ended:")
    for argv, samples in spawns.items():
        print(f"  {argv:<36} {summary(samples)}")
    print(f"one `status --json` alone, {PYTHON} (medians):")
    print(f"  {'python3 -c pass':<36} {base:7.0f} ms    1.0x")
    print(f"  {'status --json, the whole process':<36} {alone:7.0f} ms {alone / base:5.1f}x")
    for group, ms in imports.items():
        print(f"  {'  imports: ' + group:<36} {ms:7.0f} ms  (-X importtime, self)")
    print(f"  {'  the work (in-process)':<36} {work:7.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
