"""A deterministic explorer of interleavings, for the arbiter's own operations.

Each operation (acquire, release, the hook's release and its detached finish,
restore, a reboot) runs in a thread of its own with its own Arbiter, as if it
were a process of its own: its own identity (a fake pid), so that a lease it
leaves unfinished is stranded once it has crashed or exited.  The threads only
ever run one at a time.  They stop at every point where the ledger lock has
just been dropped (`crashpoints` "ledger.unlocked", the natural yield points:
what one process can observe of another changes only there) and whenever a
claim waits for a release (its `time.sleep`, on a logical clock); the
scheduler then picks who runs next.

`explore` enumerates every schedule (and, optionally, a kill -9 of the running
operation at any of those points) with at most `preemptions` switches away from
a thread that could have gone on, the context bound of CHESS: most concurrency
bugs need very few preemptions, and the count stays polynomial.  Every schedule
runs from a copy of the same starting directory on tmpfs, and `check` runs after
every step.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from charly_arbiter.core import arbiter as arbiter_module
from charly_arbiter.core import crashpoints, liveness
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import ATTACHED_DIR, Config, load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import ProcessRef
from charly_arbiter.host.sim import SimHost

YIELDS = frozenset({"ledger.unlocked", "sleep"})
STEP_TIMEOUT = 30.0
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


class Crash(BaseException):
    """A kill -9 of the operation at a yield point (nothing below it runs)."""


class Unfinished(AssertionError):
    """A schedule that did not end: an operation never yielded back."""


@dataclass
class World:
    """One schedule's copy of the simulated host, its configuration and state."""

    root: Path
    sim_dir: Path
    config_path: Path
    scheduler: Scheduler

    def host(self) -> SimHost:
        return ExplorerHost(self.sim_dir, self.scheduler)

    def config(self) -> Config:
        """The configuration as `load_config` reads it, parsed once per text: every
        operation and every step's check reads it, and parsing it again each time was
        a tenth of the explorer's time.  The key is everything the parse reads (the
        file and `attach`'s files beside it), so a change to either is read anew."""
        attached = self.config_path.parent / ATTACHED_DIR
        return _config(
            str(self.config_path),
            self.config_path.read_bytes(),
            tuple((p.name, p.read_bytes()) for p in sorted(attached.glob("*.toml"))),
        )

    def arbiter(self, pid: int) -> Arbiter:
        config = self.config()
        ledger = Ledger(config.state_dir, config.timeouts.lock_wait)
        return Arbiter(config, self.host(), ledger, owner=ProcessRef(pid, 1))

    def ledger(self) -> Ledger:
        return Ledger(self.config().state_dir)


@functools.lru_cache(maxsize=64)
def _config(path: str, text: bytes, attached: tuple[tuple[str, bytes], ...]) -> Config:
    """`World.config`'s parse; its arguments are the cache's key."""
    return load_config(Path(path), environ={})


class ExplorerHost(SimHost):
    """The simulated host, with process liveness answered by the scheduler."""

    def __init__(self, directory: Path, scheduler: Scheduler) -> None:
        super().__init__(directory, switch_timeout=2)
        self.scheduler = scheduler

    def process_alive(self, process: ProcessRef) -> bool:
        return self.scheduler.alive(process.pid)


Operation = Callable[[World, int], None]  # (world, the operation's pid)


@dataclass
class _Thread:
    name: str
    pid: int
    operation: Operation
    go: threading.Event = field(default_factory=threading.Event)
    yielded: threading.Event = field(default_factory=threading.Event)
    crash: bool = False
    done: bool = False
    error: BaseException | None = None
    thread: threading.Thread | None = None


class LogicalClock:
    """Time that moves only when it is told to: `sleep` moves it (by half a second at
    least, so that a poll loop always gets on) and returns at once.  `monotonic` is
    what a wait measures itself by; `time` and `now` are the wall clock it stands for
    (a lease's timestamps, the age claim_grace is measured by), from the moment the
    clock was made.  `installed` puts it where the arbiter reads the time."""

    def __init__(self) -> None:
        self.clock = 1000.0
        self._wall = time.time() - self.clock

    def monotonic(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        self.clock += max(seconds, 0.5)

    def time(self) -> float:
        return self._wall + self.clock

    def now(self) -> str:
        return datetime.fromtimestamp(self.time(), UTC).astimezone().isoformat(timespec="seconds")

    @contextlib.contextmanager
    def installed(self) -> Iterator[LogicalClock]:
        """The arbiter's waits, its lease timestamps and liveness's ages read this clock."""
        saved = arbiter_module.time, arbiter_module.now, liveness.time
        arbiter_module.time = self  # type: ignore[assignment]
        arbiter_module.now = self.now
        liveness.time = self  # type: ignore[assignment]
        try:
            yield self
        finally:
            arbiter_module.time, arbiter_module.now, liveness.time = saved


class Scheduler(LogicalClock):
    """Runs the operations' threads one at a time, switching only at yield points; a
    thread's sleep moves the logical clock and lets another thread run."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[_Thread] = []
        self.world: World | None = None
        self.dead: set[int] = set()
        self._by_ident: dict[int, _Thread] = {}

    # -- seen from the operations' threads ---------------------------------------------

    def alive(self, pid: int) -> bool:
        return any(t.pid == pid and not t.done for t in self.threads) and pid not in self.dead

    def at(self, step: str) -> None:
        current = self._by_ident.get(threading.get_ident())
        if current is None or step not in YIELDS:
            return
        self._pause(current)

    def _pause(self, current: _Thread) -> None:
        current.yielded.set()
        current.go.wait()
        current.go.clear()
        if current.crash:
            raise Crash(current.name)

    def spawn(self, name: str, operation: Operation) -> None:
        """A new process, started by the running one (the hook's detached release)."""
        item = _Thread(name, 1000 + len(self.threads) * 10, operation)
        self.threads.append(item)
        self._launch(item)

    def kill_all_but(self, pid: int) -> None:
        """A reboot: every other process dies where it stands."""
        for item in self.threads:
            if item.pid != pid and not item.done:
                item.crash = True
                self.dead.add(item.pid)

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.at("sleep")

    # -- seen from the exploring thread -------------------------------------------------

    def start(self, world: World) -> None:
        self.world = world
        for item in self.threads:
            self._launch(item)

    def _launch(self, item: _Thread) -> None:
        item.thread = threading.Thread(target=self._body, args=(item, self.world), daemon=True)
        item.thread.start()
        if not item.yielded.wait(STEP_TIMEOUT):
            raise Unfinished(f"{item.name} did not reach its start")
        item.yielded.clear()

    def _body(self, item: _Thread, world: World | None) -> None:
        assert world is not None
        self._by_ident[threading.get_ident()] = item
        try:
            self._pause(item)  # wait for the first turn
            item.operation(world, item.pid)
        except Crash:
            self.dead.add(item.pid)
        except BaseException as error:  # kept for the report
            item.error = error
        finally:
            item.done = True
            item.yielded.set()

    def step(self, item: _Thread, crash: bool = False) -> None:
        item.crash = item.crash or crash
        item.go.set()
        if not item.yielded.wait(STEP_TIMEOUT):
            raise Unfinished(f"{item.name} did not yield within {STEP_TIMEOUT:g} s")
        item.yielded.clear()

    def runnable(self) -> list[_Thread]:
        return [item for item in self.threads if not item.done]


@dataclass(frozen=True)
class Choice:
    thread: int  # index into the scheduler's threads
    crash: bool = False


@dataclass
class Outcome:
    """What one schedule did: the choices, the operations' results, any violation."""

    choices: list[Choice]
    errors: dict[str, BaseException | None]
    world: World


@dataclass
class Exploration:
    schedules: int = 0
    steps: int = 0
    crashes: int = 0


def explore(
    prepare: Callable[[World], None],
    operations: Sequence[tuple[str, Operation]],
    check: Callable[[World, str], None],
    finish: Callable[[Outcome], None],
    *,
    preemptions: int = 2,
    crash: bool = False,
    limit: int = 100_000,
) -> Exploration:
    """Run every schedule of `operations` (context bound `preemptions`; with `crash`,
    also a kill -9 of the running operation at any one yield point) from the state
    `prepare` builds; `check` after every step, `finish` after every schedule."""
    template = Path(tempfile.mkdtemp(prefix="charly-explore-", dir=SHM))
    template.chmod(0o700)
    stats = Exploration()
    try:
        base = _world(template / "base", Scheduler())
        prepare(base)
        prefix: list[Choice] = []
        while True:
            options_taken = _run_one(
                template, base, operations, prefix, check, finish, preemptions, crash, stats
            )
            stats.schedules += 1
            if stats.schedules >= limit:
                raise AssertionError(f"more than {limit} schedules; lower the bound")
            prefix = _next_prefix(options_taken)
            if prefix is None:
                return stats
    finally:
        shutil.rmtree(template, ignore_errors=True)


def _world(root: Path, scheduler: Scheduler) -> World:
    sim_dir = root / "host"
    sim_dir.mkdir(parents=True, exist_ok=True)
    return World(root, sim_dir, root / "arbiter.toml", scheduler)


def _run_one(
    template: Path,
    base: World,
    operations: Sequence[tuple[str, Operation]],
    prefix: list[Choice],
    check: Callable[[World, str], None],
    finish: Callable[[Outcome], None],
    preemptions: int,
    crash: bool,
    stats: Exploration,
) -> list[tuple[list[Choice], int]]:
    root = template / "run"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(base.root, root, symlinks=True)
    # The configuration names the base directory: point it at this copy.
    config = (root / "arbiter.toml").read_text().replace(str(base.root), str(root))
    (root / "arbiter.toml").write_text(config)
    scheduler = Scheduler()
    world = World(root, root / "host", root / "arbiter.toml", scheduler)
    scheduler.threads = [
        _Thread(name, 1000 + index * 10, operation)
        for index, (name, operation) in enumerate(operations)
    ]
    taken: list[tuple[list[Choice], int]] = []
    choices: list[Choice] = []
    saved_hook, saved_time = crashpoints.hook, arbiter_module.time
    crashpoints.hook = scheduler.at
    arbiter_module.time = scheduler  # type: ignore[assignment]
    try:
        scheduler.start(world)
        current: int | None = None
        preempted = 0
        crashed = False
        while scheduler.runnable():
            options = _options(scheduler, current, preempted, preemptions, crash and not crashed)
            index = len(choices)
            choice = prefix[index] if index < len(prefix) else options[0]
            if choice not in options:
                raise AssertionError(f"schedule {prefix} is not replayable at step {index}")
            taken.append((options, options.index(choice)))
            choices.append(choice)
            if (
                current is not None
                and choice.thread != current
                and not scheduler.threads[current].done
            ):
                preempted += 1
            crashed |= choice.crash
            stats.crashes += choice.crash
            current = choice.thread
            scheduler.step(scheduler.threads[choice.thread], crash=choice.crash)
            stats.steps += 1
            check(world, _describe(scheduler, choices))
    finally:
        crashpoints.hook, arbiter_module.time = saved_hook, saved_time
    errors = {item.name: item.error for item in scheduler.threads}
    finish(Outcome(choices, errors, world))
    return taken


def _options(
    scheduler: Scheduler, current: int | None, preempted: int, bound: int, may_crash: bool
) -> list[Choice]:
    runnable = [index for index, item in enumerate(scheduler.threads) if not item.done]
    if current in runnable:
        others = [index for index in runnable if index != current] if preempted < bound else []
        order = [current, *others]
    else:
        order = runnable
    options = [Choice(index) for index in order]
    if may_crash and current in runnable:
        options.append(Choice(current, crash=True))
    return options


def _next_prefix(taken: list[tuple[list[Choice], int]]) -> list[Choice] | None:
    """The next schedule in depth-first order: change the deepest choice that has an
    option left, keep everything before it."""
    for depth in range(len(taken) - 1, -1, -1):
        options, chosen = taken[depth]
        if chosen + 1 < len(options):
            return [opts[index] for opts, index in taken[:depth]] + [options[chosen + 1]]
    return None


def _describe(scheduler: Scheduler, choices: list[Choice]) -> str:
    names = [scheduler.threads[c.thread].name + ("!" if c.crash else "") for c in choices]
    return " > ".join(names)


def errors_of(outcome: Outcome, *kinds: type[BaseException]) -> dict[str, Any]:
    """The operations' errors that are not of the expected kinds."""
    return {
        name: error
        for name, error in outcome.errors.items()
        if error is not None and not isinstance(error, kinds)
    }
