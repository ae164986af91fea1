"""The OCI hook's slow path: a container that may be given a GPU.

At creation (prestart) the container's devices are mapped to tokens: each
character device by its number (`Host.device_functions`: a DRM node or an
NVIDIA node of a token's function), each CDI device name by the tokens that
list it (`cdi_devices` in arbiter.toml).  The container then takes a shared
claim as `container:NAME`; a refusal fails its start with the arbiter's
reason.  A GPU driver's node whose function the host cannot name now (its
GPU is on vfio-pci) claims every token away from its driver.  On
success a claim record (host/holders/container) makes the container a holder
the arbiter can find, stop and start again.

At stop (poststop) its claim is released: at once when that brings nothing
back, otherwise by a detached process (the stop never waits for holders),
after the lease has turned `releasing`.  A container the arbiter itself is
stopping or starting (a marker says so) is nested: its hook stops nothing
and its claim record stays, since the arbiter will start it again.

While the hook runs, a marker says so: the runtime holds the container locked
(Podman does), so no arbiter process asks the runtime about it meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

from charly_arbiter.core.host import UNKNOWN_FUNCTION
from charly_arbiter.core.model import VFIO, Mode
from charly_arbiter.errors import ClaimRefused
from charly_arbiter.hooksession import HookSession
from charly_arbiter.host.holders.container import ClaimRecord, forget_record, write_record
from charly_arbiter.host.markers import HOOK_DIR, marked
from charly_arbiter.host.procscan import process_ref
from charly_arbiter.logsetup import log_setup
from charly_arbiter.oci.spec import ContainerFacts, Device, read_facts

log = logging.getLogger(__name__)


def dispatch(stage: str, state: Any, spec: Any, engine: str | None) -> int:
    """One claim ("claim") or release ("release") for a container that may use a GPU
    (`spec` is None when its config.json could not be read: the ledger decides)."""
    log_setup(0, stderr=False)
    facts = read_facts(state, spec, engine)
    run = HookRun(facts)
    with marked(run.config.state_dir, HOOK_DIR, str(facts.ref)):
        try:
            if stage == "release":
                return run.release()
            if spec is None:
                raise ClaimRefused(
                    "its GPUs",
                    facts.ref,
                    f"the spec of container {facts.id} ({facts.bundle}/config.json) "
                    "cannot be read, so its devices are unknown",
                )
            return run.claim()
        finally:
            run.close()


class HookRun(HookSession):
    def __init__(self, facts: ContainerFacts) -> None:
        super().__init__(facts.ref)
        self.facts = facts

    # -- creation ------------------------------------------------------------------

    def claim(self) -> int:
        tokens = self.claimed_tokens()
        if not tokens:
            log.info("%s: none of its devices is a token's GPU", self.ref)
            return 0
        plan = self.acquire(Mode.SHARED, tokens)
        process = process_ref(self.roots.proc, self.facts.pid)
        write_record(
            self.config.state_dir,
            ClaimRecord(
                name=self.facts.name,
                id=self.facts.id,
                tokens=plan.tokens,
                runtime=self.facts.runtime,
                pid=process.pid if process else self.facts.pid,
                start=process.start if process else 0,
                preemptible=self.facts.preemptible,
            ),
        )
        return 0

    def claimed_tokens(self) -> list[str]:
        """The tokens the container's devices belong to (its nodes, its CDI names).

        A GPU node no function answers to now may be the node of any token that
        is away from its driver (on vfio-pci for a VM): the claim then takes
        those tokens too, so that it is refused for the reason they are away,
        or brings them home when nothing holds them.
        """
        arbiter = self.arbiter()
        numbers = [device.number for device in self.facts.devices]
        functions = arbiter.host.device_functions(numbers) if numbers else {}
        names: list[str] = []
        unknown: list[Device] = []
        for device in self.facts.devices:
            address = functions.get(device.number)
            if address is None:
                continue  # not a GPU's node
            if address == UNKNOWN_FUNCTION:
                unknown.append(device)
                continue
            token = arbiter.tokens.token_for_address(address)
            if token is not None:
                names.append(token)
        for name in self.facts.cdi_devices:
            whole = mig_gpu_name(name)
            names += [
                t.name
                for t in self.config.tokens
                if name in t.cdi_devices or whole in t.cdi_devices
            ]
        if unknown:
            nodes = ", ".join(str(device) for device in unknown)
            away = [
                spec.name
                for spec in arbiter.tokens.all().values()
                if any(function.driver in (None, VFIO) for function in spec.functions)
            ]
            if away:
                log.info("%s: %s may be a node of %s", self.ref, nodes, ", ".join(away))
            else:
                log.info("%s: %s is no token's: every token is on its driver", self.ref, nodes)
            names += away
        return list(dict.fromkeys(names))

    # -- stop ------------------------------------------------------------------------

    def release(self) -> int:
        """The runtime says the container has stopped.  Its claim record goes, unless
        the arbiter stopped it (nested): it will start it again."""
        if not self.nested():
            forget_record(self.config.state_dir, self.facts.id)
        return self.stopped(reason="stopped")


def mig_gpu_name(name: str) -> str:
    """The whole GPU's CDI name for a MIG device's, as NVIDIA's CDI spec generator names
    them (nvidia-container-toolkit's nvcdi namer): `KIND=I:J` is MIG device J of GPU
    `KIND=I`, and `KIND=migI:J` of GPU `KIND=gpuI` ("type-index"); a container on a MIG
    instance uses its GPU, shared, so the token that lists the GPU's name takes it
    (`name` itself when it is no MIG device's)."""
    kind, equals, device = name.partition("=")
    gpu, colon, mig = device.partition(":")
    if not equals or not colon or not mig.isdigit():
        return name
    if gpu.isdigit():
        return f"{kind}={gpu}"
    if gpu.startswith("mig") and gpu[3:].isdigit():
        return f"{kind}=gpu{gpu[3:]}"
    return name
