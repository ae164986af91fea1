"""`charly-arbiter hook qemu GUEST OP SUBOP EXTRA`: what libvirt's qemu hook runs.

libvirt waits for this on every VM start and stop, so the path for a domain
that claims nothing imports almost nothing: the XML is scanned as bytes and
the hook exits before the configuration, the ledger or libvirt are loaded.

Contract (docs/libvirt.md): nothing on stdout (libvirt reads it as XML for
some operations); `prepare` refuses with a non-zero exit and one or two
sentences on stderr; `release` and `reconnect` always exit 0; `migrate`
refuses a domain with an exclusive claim; every other operation exits 0 at
once.  The guest name is untrusted: it only ever becomes `libvirt:NAME`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from charly_arbiter.config import Config
    from charly_arbiter.domainxml import DomainClaim
    from charly_arbiter.model import ProcessRef

HANDLED = {"prepare": "begin", "release": "end", "reconnect": "begin", "migrate": "begin"}
ALWAYS_SUCCEED = ("release", "reconnect")
# Above libvirt's own 10 MiB: a domain whose XML is larger is refused at prepare
# rather than read in part (a hostdev past the part read would pass unclaimed).
# The same bound as domainxml.MAX_XML_BYTES (not imported: the fast path stays light).
MAX_XML = 16 << 20
# Without one of these bytes the XML cannot claim (domainxml.might_claim, without
# importing it: the fast path stays at the cost of starting Python).
CLAIM_MARKERS = (b"hostdev", b"https://charly-arbiter.org/xmlns/claim/1")
DETACHED = "finish-release"
USAGE = "usage: charly-arbiter hook qemu GUEST OPERATION SUB-OPERATION EXTRA"


def main(argv: list[str]) -> int:
    if argv[:1] == [DETACHED]:
        return _finish_release(argv[1:])
    if len(argv) < 4:
        print(f"charly-arbiter: {USAGE}", file=sys.stderr)
        return 2
    driver, guest, operation, sub_operation = argv[:4]
    extra = argv[4] if len(argv) > 4 else "-"
    if driver != "qemu" or HANDLED.get(operation) != sub_operation:
        return 0
    _stdout_to_stderr()
    try:
        return _dispatch(guest, operation, extra)
    except Exception as error:  # the boundary: one sentence, and the right exit code
        from charly_arbiter.errors import ArbiterError

        if isinstance(error, ArbiterError):
            _say(str(error), error.hint)
        else:
            if os.environ.get("CHARLY_ARBITER_DEBUG"):
                import traceback

                traceback.print_exc()
            _say(f"internal error in the {operation} hook for {guest!r}: {error!r}", None)
        return 0 if operation in ALWAYS_SUCCEED else 1


def _dispatch(guest: str, operation: str, extra: str) -> int:
    xml = _read_stdin()
    # Too large to read whole: refused at prepare; otherwise the ledger decides.
    oversized = len(xml) > MAX_XML
    if oversized and operation == "prepare":
        _say(
            f"the domain XML of {guest!r} is larger than {MAX_XML >> 20} MiB; "
            "it is refused rather than read in part",
            "shorten its <description> or metadata",
        )
        return 1
    if not oversized and not any(marker in xml for marker in CLAIM_MARKERS):
        return 0  # the fast path: no hostdev, no claim element
    from charly_arbiter.domainxml import parse_domain
    from charly_arbiter.logsetup import log_setup
    from charly_arbiter.model import Claimant

    log_setup(0)
    ref = str(Claimant.parse(f"libvirt:{guest}"))
    facts = None if oversized else parse_domain(xml, guest)
    if facts is not None and not facts.mentions_gpus:
        return 0
    hook = _Hook(ref, guest)
    from charly_arbiter.holders.libvirt import HOOK_DIR, marked

    # libvirt holds this domain locked until we exit: other arbiter processes
    # (a nested hook, a parallel start) must not wait on it meanwhile.
    with marked(hook.config.state_dir, HOOK_DIR, ref):
        try:
            if operation == "release":
                return hook.release(extra)  # by the ledger alone: its tokens may be gone
            if facts is None:
                return hook.reconnect(None) if operation == "reconnect" else 1
            claim = hook.claim(facts)
            if operation == "prepare":
                return hook.prepare(claim) if claim else 0
            if operation == "reconnect":
                return hook.reconnect(claim)
            return hook.migrate(claim)
        finally:
            hook.close()


class _Hook:
    """The slow path: a domain whose XML may claim a GPU."""

    def __init__(self, ref: str, guest: str) -> None:
        import logging

        from charly_arbiter.config import load_config
        from charly_arbiter.holders.libvirt import ENV_HOOK_GUEST

        self.log = logging.getLogger("charly_arbiter.hook")
        self.ref = ref
        self.guest = guest
        # The libvirt holder source never touches (or enumerates past) this domain.
        os.environ[ENV_HOOK_GUEST] = guest
        self.config = load_config()
        _log_to_file(self.config)
        self._arbiter: Any = None

    def arbiter(self) -> Any:
        if self._arbiter is None:
            from charly_arbiter.arbiter import Arbiter
            from charly_arbiter.eventlog import events_for
            from charly_arbiter.hosts import open_host
            from charly_arbiter.ledger import Ledger

            config = self.config
            ledger = Ledger(config.state_dir, config.timeouts.lock_wait)
            self._arbiter = Arbiter(config, open_host(config), ledger, events_for(config))
        return self._arbiter

    def close(self) -> None:
        if self._arbiter is not None:
            self._arbiter.host.close()

    def claim(self, facts: Any) -> DomainClaim | None:
        from charly_arbiter.domainxml import mdev_parent, resolve_claim
        from charly_arbiter.holders.libvirt import DEFAULT_SYSFS

        arbiter = self.arbiter()
        return resolve_claim(
            facts, arbiter.token_for_address, lambda uuid: mdev_parent(DEFAULT_SYSFS, uuid)
        )

    def nested(self) -> bool:
        """Whether this hook runs because the arbiter itself stops or starts this domain."""
        from charly_arbiter.holders.libvirt import is_acting

        return is_acting(self.config.state_dir, self.ref)

    def prepare(self, claim: DomainClaim) -> int:
        policy = self.policy()
        arbiter = self.arbiter()
        if policy.refuse_kinds:
            _refuse_listed_stops(arbiter, self.ref, claim, policy)
        plan = arbiter.acquire(
            self.ref, claim.mode, list(claim.tokens), transient=claim.transient, policy=policy
        )
        stopped = ", ".join(step.holder for step in plan.stops)
        self.log.info(
            "%s holds %s (%s)%s",
            self.ref,
            ", ".join(plan.tokens),
            plan.mode,
            f"; stopped {stopped}" if stopped else "",
        )
        return 0

    def policy(self) -> Any:
        from charly_arbiter.holders import SOURCES
        from charly_arbiter.planner import Policy

        if self.nested():
            return Policy(
                refuse_kinds=frozenset({*SOURCES, "process"}),
                refuse_hint="{claimant} was started by the arbiter itself, which never "
                "stops {holder} from a nested hook; stop {holder} first",
            )
        if self.config.libvirt_preemption == "refuse":
            return Policy(
                refuse_kinds=frozenset({"libvirt"}),
                refuse_hint="stop {holder} first (virsh shutdown), or run `charly-arbiter "
                "acquire --exclusive {claimant} {token}` outside libvirt, then start "
                "the VM again",
            )
        from charly_arbiter.planner import NO_POLICY

        return NO_POLICY

    def release(self, reason: str) -> int:
        from charly_arbiter.ledger import Ledger
        from charly_arbiter.releasing import Releaser

        reason = "" if reason == "-" else reason
        lease = Ledger(self.config.state_dir).read().lease_of(self.ref)
        nested = self.nested()
        self.log.info(
            "%s stopped (%s)%s",
            self.ref,
            reason or "no reason given",
            " by the arbiter" if nested else "",
        )
        if lease is None:
            return 0  # a refused prepare, or a holder whose lease moved: nothing is ours
        success = reason != "failed"
        arbiter = self.arbiter()
        if lease.unrestored() and not nested:
            # Starting what the claim stopped calls libvirt and may take a while:
            # a detached process does it, so `virsh destroy` returns at once.  The
            # lease turns releasing first, under the lock, so that a `prepare` of
            # this domain right after waits for the release to end.
            if Releaser(arbiter).begin(self.ref, success, reason):
                _spawn_finish_release(self.config, self.ref, reason, arbiter.owner)
            return 0
        # libvirt says the domain has stopped: no need to ask whether it runs.
        arbiter.release_claimant(self.ref, success=success, reason=reason, force=True)
        return 0

    def reconnect(self, claim: DomainClaim | None) -> int:
        """libvirtd restarted and found this domain running: its lease stays as it is."""
        from charly_arbiter.ledger import Ledger

        state = Ledger(self.config.state_dir).read()
        lease = state.lease_of(self.ref)
        if lease is not None:
            self.log.info(
                "%s runs on after a libvirtd restart; its %s lease stays", self.ref, lease.mode
            )
        elif claim is not None:
            others = sorted(
                {other.claimant for token in claim.tokens for other in state.leases_on(token)}
            )
            if others:
                # Its GPU sits in another lease (left stranded while libvirtd was down):
                # that one must be restored first, acquiring now would only be refused.
                self.log.warning(
                    "%s runs with %s but holds no lease; %s still lease it: run "
                    "`charly-arbiter restore --stranded`, then `charly-arbiter acquire --%s %s %s`",
                    self.ref,
                    ", ".join(claim.tokens),
                    ", ".join(others),
                    claim.mode,
                    self.ref,
                    " ".join(claim.tokens),
                )
            else:
                self.log.warning(
                    "%s runs with %s but holds no lease; run `charly-arbiter acquire --%s %s %s`",
                    self.ref,
                    ", ".join(claim.tokens),
                    claim.mode,
                    self.ref,
                    " ".join(claim.tokens),
                )
        return 0

    def migrate(self, claim: DomainClaim | None) -> int:
        from charly_arbiter.model import Mode

        if claim is not None and claim.mode is Mode.EXCLUSIVE:
            _say(
                f"{self.ref} cannot migrate: it holds {', '.join(claim.tokens)} exclusively "
                "(a passed-through GPU stays on its host)",
                f"shut {self.guest} down and start it on the other host instead",
            )
            return 1
        return 0


def _refuse_listed_stops(arbiter: Any, ref: str, claim: DomainClaim, policy: Any) -> None:
    """The planner stops shared claimants whatever the policy; refuse them here too."""
    from charly_arbiter.errors import ClaimRefused

    plan = arbiter.plan(
        ref, claim.mode, list(claim.tokens), transient=claim.transient, policy=policy
    )
    for step in plan.stops:
        if step.holder.partition(":")[0] in policy.refuse_kinds:
            token = next(iter(step.shared_tokens or plan.tokens))
            raise ClaimRefused(
                token,
                ref,
                f"it is in use by {step.holder}, and this configuration does not stop "
                f"{step.holder.partition(':')[0]} holders from a hook",
                hint=policy.refuse_hint.format(holder=step.holder, claimant=ref, token=token),
            )


def _spawn_finish_release(config: Config, ref: str, reason: str, owner: ProcessRef) -> None:
    """Hand the rest of `release` to a process of its own, with nothing of libvirt's.

    The child gets a fixed environment, so it is pointed at the directory this
    package was loaded from (an installed package, or a checkout on PYTHONPATH).
    It takes the releasing lease over from `owner` (this hook), which may have
    exited by the time it looks.
    """
    from pathlib import Path

    from charly_arbiter.run import spawn_detached

    package_parent = str(Path(__file__).resolve().parent.parent)
    spawn_detached(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from charly_arbiter.hook import main; sys.exit(main(sys.argv[2:]))",
            package_parent,
            DETACHED,
            str(config.path or "-"),
            str(config.state_dir),
            config.host,
            ref,
            reason or "-",
            f"{owner.pid}:{owner.start}",
        ]
    )


def _finish_release(argv: list[str]) -> int:
    """The detached half of `release`: send home, restore holders, drop the lease."""
    if len(argv) != 6:
        print(
            f"charly-arbiter: usage: hook {DETACHED} CONFIG STATE_DIR HOST CLAIMANT REASON "
            "PID:START",
            file=sys.stderr,
        )
        return 2
    from pathlib import Path

    from charly_arbiter.arbiter import Arbiter
    from charly_arbiter.config import load_config
    from charly_arbiter.eventlog import events_for
    from charly_arbiter.hosts import open_host
    from charly_arbiter.ledger import Ledger
    from charly_arbiter.logsetup import log_setup
    from charly_arbiter.model import ProcessRef
    from charly_arbiter.releasing import Releaser

    config_path, state_dir, host, ref, reason, began_by = argv
    reason = "" if reason == "-" else reason
    pid, _, start = began_by.partition(":")
    takeover = ProcessRef(int(pid), int(start or "0"))
    log_setup(1)
    config = load_config(
        None if config_path == "-" else Path(config_path), state_dir=Path(state_dir), host=host
    )
    _log_to_file(config)
    ledger = Ledger(config.state_dir, config.timeouts.lock_wait)
    arbiter = Arbiter(config, open_host(config), ledger, events_for(config))
    try:
        Releaser(arbiter).finish(ref, reason != "failed", reason, takeover=takeover)
    finally:
        arbiter.host.close()
    return 0


def _read_stdin() -> bytes:
    """The whole XML up to MAX_XML bytes (one byte more says it was larger)."""
    try:
        return sys.stdin.buffer.read(MAX_XML + 1)
    except (OSError, ValueError, AttributeError):
        return b""


def _stdout_to_stderr() -> None:
    """Nothing this process (or a child) writes can reach libvirt's stdout pipe."""
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(1)
    sys.stdout = sys.stderr


def _log_to_file(config: Config) -> None:
    import logging

    if config.hook_log is None:
        return
    handler = logging.FileHandler(config.hook_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("charly_arbiter")
    for existing in root.handlers:
        existing.setLevel(logging.WARNING)  # stderr stays quiet; the file gets the steps
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))


def _say(message: str, hint: str | None) -> None:
    """One or two sentences on stderr; names in them (`libvirt:../../x`) stay as they are."""
    text = f"charly-arbiter: {_sentence(message)}"
    if hint:
        text += f" Hint: {_sentence(hint)}"
    print(text, file=sys.stderr)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else f"{text}."
