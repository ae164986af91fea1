"""libvirt domains as holders: found by the same XML rules as the hook's claims.

Three rules make calling libvirt from inside a hook safe (docs/libvirt.md has
the evidence from a real libvirtd):

- Never touch the hook's own domain (`subject`), and never enumerate
  domains while in a hook: libvirt holds the hook's domain locked, and every
  enumeration (`listAllDomains`, even `listDomainsID`) waits on that lock until
  the hook exits.  In a hook the candidates are named by the ledger and the
  configuration and looked up one by one.
- Bound every call (`timeouts.libvirt_call`, or the stop/start timeouts): a
  call that does not return is abandoned in its thread and reported.
- Depth one: before stopping or starting a domain, a marker under the state
  directory says so, and that domain's own hook (run by libvirtd while we
  wait) sees it and never preempts or starts anything itself.
- A domain whose own hook is running (a marker the hook writes) is locked by
  libvirt: it is never looked up, stopped or started meanwhile, and counts as
  alive.  Without this, a nested or parallel hook waits on it until timeout.

libvirt-python is imported on first use, never by the hook's fast path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind, LeaseState, Mode
from charly_arbiter.errors import ArbiterError, HolderError, HostError, LedgerCorrupt
from charly_arbiter.host.blocking import TimedOut, bounded
from charly_arbiter.host.markers import ACTING_DIR, in_hook, marked
from charly_arbiter.host.procscan import command_lines
from charly_arbiter.host.sysfs import HOST_ROOTS, Roots
from charly_arbiter.libvirt.domainxml import (
    DomainXMLError,
    mdev_parent,
    parse_domain,
    resolve_claim,
)

log = logging.getLogger(__name__)

KIND = HolderKind.LIBVIRT
POLL_SECONDS = 0.2

T = TypeVar("T")


class LibvirtHolders:
    kind = KIND

    def __init__(
        self,
        config: Config,
        subject: str | None = None,
        roots: Roots = HOST_ROOTS,
    ) -> None:
        """`subject` is the domain whose hook this process runs in (None outside a hook)."""
        self.config = config
        self.uri = config.libvirt_uri
        self.timeout = config.timeouts.libvirt_call
        self.subject = subject or None
        self.roots = roots
        self.configured: dict[str, HolderConfig] = {
            h.ref.name: h for h in config.holders if h.ref.kind == KIND
        }
        self._stop_methods: dict[str, str] = {}
        self._connection: Any = None

    # -- HolderSource ------------------------------------------------------------

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        owner = {f.address: t.name for t in tokens for f in t.functions}
        names = {t.name for t in tokens}
        found = []
        for name in self._candidate_names():
            domain = self._lookup(name)
            if domain is None:
                continue
            holder = self._holder(name, domain, owner, names)
            if holder is not None:
                found.append(holder)
        return found

    def is_running(self, ref: Claimant) -> bool:
        name = _name(ref)
        if name == self.subject or in_hook(self.config.state_dir, ref):
            # Starting or stopping, and locked by libvirt while its hook runs: alive for us.
            return True
        try:
            domain = self._lookup(name)
        except HostError as error:
            # libvirtd is down: QEMU may still run (or have died meanwhile); ask /proc.
            log.info("%s: %s; looking for its QEMU process instead", ref, error)
            return self._qemu_process_alive(name)
        return domain is not None and bool(self._call(ref, "query", domain.isActive))

    def stop(self, ref: Claimant) -> None:
        name = _name(ref)
        self._refuse_subject(ref, "stop")
        domain = self._lookup(name)
        if domain is None or not self._call(ref, "query", domain.isActive):
            return
        method = self._stop_methods.get(name) or self._stop_method(name, domain)
        budget = self.config.timeouts.holder_stop
        with self.acting(ref):
            if method == "managedsave":
                self._call(ref, "managedsave", lambda: domain.managedSave(0), budget)
            elif method == "shutdown":
                self._call(ref, "shut down", domain.shutdown)
                if not self._wait_inactive(ref, domain, budget):
                    log.warning("%s did not shut down within %g s; destroying it", ref, budget)
                    self._call(ref, "destroy", domain.destroy)
            else:
                self._call(ref, "destroy", domain.destroy)
        if self._call(ref, "query", domain.isActive):
            raise HolderError(ref, "stop", f"it still runs after {method}")

    def start(self, ref: Claimant) -> None:
        name = _name(ref)
        self._refuse_subject(ref, "start")
        domain = self._lookup(name)
        if domain is None:
            raise HolderError(ref, "start", f"there is no domain {name!r} on {self.uri}")
        if self._call(ref, "query", domain.isActive):
            return
        with self.acting(ref):
            # create() restores a managed save image when there is one.
            self._call(ref, "start", domain.create, self.config.timeouts.holder_start)
        if not self._call(ref, "query", domain.isActive):
            raise HolderError(ref, "start", "it does not run after starting it")

    def definition(self, name: str) -> bytes | None:
        """The persistent XML of domain `name` (what its next start uses), or None when
        libvirt has no domain of that name."""
        import libvirt

        domain = self._lookup(name)
        if domain is None:
            return None
        flags = libvirt.VIR_DOMAIN_XML_INACTIVE
        xml = self._call(f"{KIND}:{name}", "read the XML of", lambda: domain.XMLDesc(flags))
        return str(xml).encode()

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None

    # -- depth one -----------------------------------------------------------------

    @contextlib.contextmanager
    def acting(self, ref: Claimant) -> Iterator[None]:
        """Mark `ref` as being stopped or started by this process, for its own hook."""
        with marked(self.config.state_dir, ACTING_DIR, ref):
            yield

    # -- discovery -------------------------------------------------------------------

    def _candidate_names(self) -> list[str]:
        """Every domain outside a hook; in a hook only those the ledger or config name."""
        if self.subject is None:
            connection = self._connect()
            domains = self._call(f"{KIND}:*", "list domains", connection.listAllDomains)
            names = {str(domain.name()) for domain in domains}
        else:
            names = set(self.configured) | self._ledger_names()
        return sorted(
            name
            for name in names
            if name
            and name != self.subject
            and not in_hook(self.config.state_dir, f"{KIND}:{name}")
        )

    def _ledger_names(self) -> set[str]:
        """The libvirt domains the ledger names: holders it records as stopped, and
        claimants of active leases (a shared claimant VM is preempted as a holder).

        Not the claimants of unfinished leases: looking one up from a hook can
        deadlock.  A VM whose prepare hook waits for its own release is locked by
        libvirt from before its hook could leave a marker; that release starts a
        holder VM, whose nested hook must not wait on the first VM's lock.
        """
        from charly_arbiter.core.ledger import Ledger

        try:
            leases = Ledger(self.config.state_dir).read().leases
        except LedgerCorrupt:
            leases = ()  # the arbiter reports it on its own path
        refs = [record.holder for lease in leases for record in lease.unrestored()]
        refs += [lease.claimant for lease in leases if lease.state is LeaseState.ACTIVE]
        return {ref.name for ref in refs if ref.kind == KIND}

    def _holder(
        self, name: str, domain: Any, owner: dict[str, str], names: set[str]
    ) -> Holder | None:
        ref = Claimant.of(KIND, name)
        configured = self.configured.get(name)
        try:
            xml = str(self._call(ref, "read the XML of", lambda: domain.XMLDesc(0)))
            facts = parse_domain(xml.encode(), name)
        except DomainXMLError as error:
            log.warning("%s: ignored as a holder: %s", ref, error)
            return None
        claim = resolve_claim(facts, owner.get, lambda uuid: mdev_parent(self.roots.sys, uuid))
        held = [t for t in (claim.tokens if claim else ()) if t in names]
        held += [t for t in (configured.tokens if configured else ()) if t in names]
        if not held:
            return None
        method = (claim.stop if claim else None) or (configured.stop if configured else "shutdown")
        self._stop_methods[name] = method
        running = bool(self._call(ref, "query", domain.isActive))
        return Holder(
            ref=ref,
            tokens=tuple(dict.fromkeys(held)),
            preemptible=bool(claim and claim.preemptible)
            or bool(configured and configured.preemptible),
            running=running,
            how=f"virsh {method}",
            detail=f"{claim.mode} claim" if claim else "listed in arbiter.toml",
            # A vGPU (mdev) claim uses the GPU on its home driver; a PCI hostdev, or a
            # domain listed in arbiter.toml, has it passed through.
            passthrough=not (claim is not None and claim.mode is Mode.SHARED),
        )

    def _stop_method(self, name: str, domain: Any) -> str:
        configured = self.configured.get(name)
        try:
            xml = str(self._call(f"{KIND}:{name}", "read the XML of", lambda: domain.XMLDesc(0)))
            stop = parse_domain(xml.encode(), name).stop
        except DomainXMLError:
            stop = None
        return stop or (configured.stop if configured else "shutdown")

    # -- libvirt, bounded ------------------------------------------------------------------

    def _connect(self) -> Any:
        if self._connection is None:
            import libvirt

            # libvirt prints every error to stderr by default; they are raised instead.
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            try:
                self._connection = self._call(
                    f"{KIND}:*", "connect to", lambda: libvirt.open(self.uri)
                )
            except HolderError as error:
                raise HostError(f"cannot connect to libvirt at {self.uri}: {error.why}") from None
        return self._connection

    def _lookup(self, name: str) -> Any:
        """The domain, or None when libvirt has no domain of that name."""
        import libvirt

        connection = self._connect()
        try:
            return self._call(f"{KIND}:{name}", "look up", lambda: connection.lookupByName(name))
        except HolderError as error:
            cause = error.__cause__
            if isinstance(cause, libvirt.libvirtError) and (
                cause.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN
            ):
                return None
            raise

    def _call(
        self, ref: str, action: str, call: Callable[[], T], timeout: float | None = None
    ) -> T:
        """One libvirt call, given up on after `timeout` (its thread is abandoned)."""
        limit = timeout or self.timeout
        try:
            return bounded(call, limit, f"libvirt {action}")
        except TimedOut:
            raise HolderError(ref, action, f"libvirt did not answer within {limit:g} s") from None
        except ArbiterError:
            raise
        except Exception as error:
            raise HolderError(ref, action, str(error).strip() or type(error).__name__) from error

    def _wait_inactive(self, ref: Claimant, domain: Any, budget: float) -> bool:
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            if not self._call(ref, "query", domain.isActive):
                return True
            time.sleep(POLL_SECONDS)
        return False

    def _refuse_subject(self, ref: Claimant, action: str) -> None:
        if _name(ref) == self.subject:
            raise HolderError(ref, action, "it is the domain this hook runs for")
        if in_hook(self.config.state_dir, ref):
            raise HolderError(ref, action, "its own libvirt hook is running; try again")

    def _qemu_process_alive(self, name: str) -> bool:
        """Whether a QEMU process runs for `name` (`-name guest=NAME,...` on its command line)."""
        return bool(
            command_lines(self.roots.proc, lambda argv: any(_guest_option(a) == name for a in argv))
        )


def _guest_option(argument: bytes) -> str | None:
    """The NAME of a QEMU `guest=NAME,...` option value (`,,` is an escaped comma)."""
    if not argument.startswith(b"guest="):
        return None
    text = argument[len(b"guest=") :].decode(errors="replace")
    name, index = [], 0
    while index < len(text):
        if text[index] == ",":
            if text[index + 1 : index + 2] != ",":
                break
            index += 1
        name.append(text[index])
        index += 1
    return "".join(name)


def _name(ref: str) -> str:
    claimant = Claimant.parse(ref)
    if claimant.kind != KIND:
        raise HolderError(ref, "handle", "it is not a libvirt domain")
    return claimant.name


def reachable(uri: str) -> str | None:
    """Why libvirt at `uri` cannot be used by this host (None when it can): for `doctor`."""
    try:
        import libvirt
    except ImportError:
        return "python3-libvirt is not installed"
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    try:
        connection = libvirt.openReadOnly(uri)
    except libvirt.libvirtError as error:
        return f"{uri} is not reachable: {error}"
    connection.close()
    return None
