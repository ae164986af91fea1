"""A hook's session: what the libvirt, OCI and Proxmox hooks share past their fast path.

Each hook's slow path (`libvirt/hookrun`, `oci/hookrun`, `proxmox/hookrun`) is a
`HookSession` for its subject (`libvirt:NAME`, `container:NAME`, `proxmox:VMID`):
the configuration read once, its log set up, and an arbiter built only when a
claim or a release needs one, whose holder sources never ask about the subject
(libvirt, the runtime or qemu-server hold it locked until the hook returns).
The session decides the rest the same way for all three: whether the call is
nested (the arbiter itself is stopping or starting the subject), and a stop's
release, which is handed to a detached process when it brings holders back.

A detached process is the CLI's hidden verb (`charly-arbiter _finish-release`,
`_watch-start`; `DETACHED` lists them, cli/__init__.py runs them), fed one
`Handoff` as JSON in a single argument: nothing positional, no sentinel
strings, and its paths absolute.  It runs in its own session with a fixed
environment, from `/`, its stdin, stdout and stderr on /dev/null (the hook's
caller waits for EOF on them); it logs to `hook_log` and the system log.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from charly_arbiter.compose import build_arbiter, token_catalogue
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config, load_config
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import CLAIMANT_KINDS, SCREEN_KINDS, Mode, ProcessRef
from charly_arbiter.core.planner import NO_POLICY, ClaimPlan, Policy
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import UsageError
from charly_arbiter.host.markers import is_acting
from charly_arbiter.host.run import spawn_detached
from charly_arbiter.host.sysfs import HOST_ROOTS
from charly_arbiter.logsetup import log_setup

log = logging.getLogger(__name__)

# The hidden verbs a hook starts (their names show in ps): the rest of a release that
# brings holders back, and the Proxmox hook's watch of a start after pre-start.
FINISH_RELEASE = "_finish-release"
WATCH_START = "_watch-start"
DETACHED = (FINISH_RELEASE, WATCH_START)


class HookSession:
    """What a hook call that has to decide holds: the configuration (read once, its
    log set up) and, built only when it is needed, the arbiter, whose holder sources
    never ask about `subject` (libvirt or the runtime would wait on this very call)."""

    def __init__(self, subject: str) -> None:
        self.ref = subject
        self.roots = HOST_ROOTS  # where the hook's caller runs: this machine's /sys, /proc
        self.config = load_config()
        log_to_file(self.config)
        self._arbiter: Arbiter | None = None
        self._tokens: TokenCatalogue | None = None

    def tokens(self) -> TokenCatalogue:
        """The host's tokens, read from its PCI side alone until a claim needs the
        whole host (whose arbiter then uses them too, read once)."""
        if self._arbiter is not None:
            return self._arbiter.tokens
        if self._tokens is None:
            self._tokens = token_catalogue(self.config)
        return self._tokens

    def arbiter(self) -> Arbiter:
        if self._arbiter is None:
            self._arbiter = build_arbiter(self.config, subject=self.ref, tokens=self._tokens)
        return self._arbiter

    def close(self) -> None:
        if self._arbiter is not None:
            self._arbiter.host.close()

    def nested(self) -> bool:
        """Whether this hook runs because the arbiter itself stops or starts its subject."""
        return is_acting(self.config.state_dir, self.ref)

    def policy(self) -> Policy:
        """A nested hook never stops a holder (its caller is stopping or starting
        one already); otherwise the hook's own rules, `own_policy`."""
        if self.nested():
            return Policy(
                refuse_kinds=frozenset((*CLAIMANT_KINDS, *SCREEN_KINDS)),
                refuse_hint="{claimant} was started by the arbiter itself, which never "
                "stops {holder} from a nested hook; stop {holder} first",
            )
        return self.own_policy()

    def own_policy(self) -> Policy:
        return NO_POLICY

    def acquire(self, mode: Mode, tokens: Sequence[str], *, transient: bool = False) -> ClaimPlan:
        """The subject's claim, by the session's policy (a nested hook stops nothing),
        logged with what it stopped.  A refusal is raised: the start fails closed."""
        plan = self.arbiter().acquire(
            self.ref, mode, list(tokens), transient=transient, policy=self.policy()
        )
        stopped = ", ".join(step.holder for step in plan.stops)
        log.info(
            "%s holds %s (%s)%s",
            self.ref,
            ", ".join(plan.tokens),
            plan.mode,
            f"; stopped {stopped}" if stopped else "",
        )
        return plan

    def stopped(self, *, success: bool = True, reason: str = "", told: str = "") -> int:
        """The subject has stopped (its manager says so: the claimant is not asked
        whether it runs, and the release is never refused).  A lease that brings
        holders back turns `releasing` here, under the lock, so that a start of the
        subject right after waits for it; the rest is `_finish-release`, detached, so
        that the stop never waits for holders.  A lease with nothing to bring back,
        or a nested stop (the arbiter stops its subject for another claim, and waits
        for this hook), is released here.  `told` is how the log line says the stop
        (libvirt's reason).  Exit code 0, always."""
        lease = Ledger(self.config.state_dir).read().lease_of(self.ref)
        nested = self.nested()
        log.info(
            "%s stopped%s%s",
            self.ref,
            f" ({told})" if told else "",
            " by the arbiter" if nested else "",
        )
        if lease is None:
            return 0  # a refused start, or a holder whose lease moved: nothing is ours
        arbiter = self.arbiter()
        if lease.unrestored() and not nested:
            begun = arbiter.releaser().begin(self.ref, success, reason)
            if begun is not None and begun.lease is not None:
                spawn(
                    FINISH_RELEASE,
                    Handoff.of(
                        self.config, self.ref, reason=reason, success=success, owner=arbiter.owner
                    ),
                )
            return 0
        arbiter.release_claimant(self.ref, success=success, reason=reason, force=True, stopped=True)
        return 0


def log_to_file(config: Config) -> None:
    """The steps of every hook call go to `hook_log` when it is set (the system log
    keeps only the warnings)."""
    if config.hook_log is None:
        return
    handler = logging.FileHandler(config.hook_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("charly_arbiter")
    for existing in root.handlers:
        existing.setLevel(logging.WARNING)
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))


# -- what a hook hands a detached process ------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """Everything a detached process needs, in one value: the arbiter it builds
    (configuration file, state directory, host), whom it acts for, and what the
    hook knew.  `owner` is the hook whose releasing lease `_finish-release` takes
    over; `created` is the lease `_watch-start` watches (another start's is not
    its business)."""

    config: str | None  # the configuration file, absolute; None: no file (the defaults)
    state_dir: str
    host: str
    claimant: str
    reason: str = ""
    success: bool = True
    owner: ProcessRef | None = None
    created: str = ""

    @classmethod
    def of(
        cls,
        config: Config,
        claimant: str,
        *,
        reason: str = "",
        success: bool = True,
        owner: ProcessRef | None = None,
        created: str = "",
    ) -> Handoff:
        return cls(
            config=str(config.path.absolute()) if config.path is not None else None,
            state_dir=str(config.state_dir.absolute()),
            host=config.host,
            claimant=str(claimant),
            reason=reason,
            success=success,
            owner=owner,
            created=created,
        )

    def to_json(self) -> str:
        value: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.owner is not None:
            value["owner"] = {"pid": self.owner.pid, "start": self.owner.start}
        # ASCII only: any path (one not in UTF-8 too) survives the trip through argv.
        return json.dumps(value, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Handoff:
        """The value `to_json` wrote; `UsageError` for anything else (exit 2)."""
        try:
            value = json.loads(text)
        except ValueError as error:
            raise UsageError(f"the hand-off is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise UsageError("the hand-off is not a JSON object")
        types: dict[str, tuple[type, ...]] = {
            "config": (str, type(None)),
            "state_dir": (str,),
            "host": (str,),
            "claimant": (str,),
            "reason": (str,),
            "success": (bool,),
            "owner": (dict, type(None)),
            "created": (str,),
        }
        unknown = sorted(set(value) - set(types))
        missing = sorted({"config", "state_dir", "host", "claimant"} - set(value))
        if unknown or missing:
            raise UsageError(
                "the hand-off "
                + "; ".join(
                    part
                    for part in (
                        f"has no field {', '.join(unknown)}" if unknown else "",
                        f"lacks {', '.join(missing)}" if missing else "",
                    )
                    if part
                )
            )
        for key, allowed in types.items():
            if key in value and not isinstance(value[key], allowed):
                raise UsageError(f"the hand-off's {key} is not a {allowed[0].__name__}")
        owner = value.pop("owner", None)
        if owner is not None:
            pid, start = owner.get("pid"), owner.get("start", 0)
            if set(owner) - {"pid", "start"} or not _count(pid) or not _count(start):
                raise UsageError("the hand-off's owner is not {pid, start} as whole numbers")
            owner = ProcessRef(pid, start)
        for key in ("config", "state_dir"):
            path = value.get(key)
            if path is not None and not Path(path).is_absolute():
                raise UsageError(f"the hand-off's {key} is not an absolute path: {path!r}")
        return cls(**value, owner=owner)

    def load_config(self) -> Config:
        return load_config(
            Path(self.config) if self.config is not None else None,
            state_dir=Path(self.state_dir),
            host=self.host,
        )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def spawn(verb: str, handoff: Handoff) -> None:
    """Start `charly-arbiter VERB HANDOFF` detached, with nothing of the hook's: its
    own session, a fixed environment and `/` as its directory, /dev/null for its
    stdin, stdout and stderr.  The environment carries no PYTHONPATH, so the child
    is pointed at the directory this package was loaded from (an installed package,
    or a checkout)."""
    if verb not in DETACHED:
        raise ValueError(f"{verb!r} is not a detached verb ({', '.join(DETACHED)})")
    package_parent = str(Path(__file__).resolve().parent.parent)
    spawn_detached(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from charly_arbiter.cli import main; main(sys.argv[2:])",
            package_parent,
            verb,
            handoff.to_json(),
        ]
    )


def detached_arbiter(handoff: Handoff) -> tuple[Config, Arbiter]:
    """The configuration and the arbiter of a detached process (no subject: it asks
    every source, the claimant's own included), its log set up."""
    log_setup(1, stderr=False)  # (its stderr is /dev/null: it runs detached)
    config = handoff.load_config()
    log_to_file(config)
    return config, build_arbiter(config)


def finish_release(handoff: Handoff) -> int:
    """`_finish-release`: the rest of a release a hook began (tokens home, holders
    back, the lease gone), taking the releasing lease over from `handoff.owner`,
    which may have exited by the time this looks."""
    _, arbiter = detached_arbiter(handoff)
    try:
        arbiter.releaser().finish(
            handoff.claimant, handoff.success, handoff.reason, takeover=handoff.owner
        )
    finally:
        arbiter.host.close()
    return 0
