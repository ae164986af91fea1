"""The kinds as types: holder and claimant kinds, event kinds and the policies are
StrEnums in core, one source each.  Their values are what the ledger, arbiter.toml,
the history, the journal, metrics, alert rules and the Cockpit page spell, so they
are pinned here: renaming a member is free, changing a value is not."""

from __future__ import annotations

import json

from charly_arbiter.core.config import LISTED_KINDS, load_config
from charly_arbiter.core.events import EventKind, describe
from charly_arbiter.core.model import (
    CLAIMANT_KINDS,
    KINDS,
    SCREEN_KINDS,
    Claimant,
    ConsolePolicy,
    HolderKind,
    Preemption,
    ProcessPolicy,
)

HOLDER_VALUES = [
    "libvirt",
    "systemd",
    "container",
    "process",
    "nvidia-persistence",
    "proxmox",
    "lxc",
    "arbiter",
    "display-manager",
    "session",
    "systemd-user",
]
EVENT_VALUES = [
    "claim", "refused", "stopping", "preempted", "switching", "switched", "active",
    "poisoned", "release", "failed", "restore", "starting", "restored", "restore-failed",
    "poison-cleared", "mismatch", "adopted", "send-home", "recovered",
    "mig", "mig-done", "vf-count", "vf-counted", "told", "session-ended", "sleep-blocked",
    "sleep-allowed", "sleep-lock-failed",
]  # fmt: skip


def test_the_values_are_the_ones_every_reader_knows() -> None:
    assert [kind.value for kind in HolderKind] == HOLDER_VALUES
    assert [kind.value for kind in EventKind] == EVENT_VALUES
    assert [p.value for p in ProcessPolicy] == ["refuse", "terminate"]
    assert [p.value for p in Preemption] == ["stop", "refuse"]
    assert [p.value for p in ConsolePolicy] == ["refuse", "release"]


def test_every_kind_has_its_name_rules_and_claimants_are_all_but_the_host_s_own() -> None:
    assert set(KINDS) == set(HolderKind)
    assert set(CLAIMANT_KINDS) == set(HolderKind) - {
        HolderKind.NVIDIA_PERSISTENCE,
        HolderKind.ARBITER,
        *SCREEN_KINDS,
    }
    assert set(LISTED_KINDS) <= set(CLAIMANT_KINDS)
    ref = Claimant.parse("libvirt:win11")
    assert (
        ref.kind is HolderKind.LIBVIRT and json.dumps({"kind": ref.kind}) == '{"kind": "libvirt"}'
    )


def test_every_event_kind_has_a_sentence_of_its_own() -> None:
    """`describe` falls back to `KIND key=value` for a kind it does not know."""
    fallback = [kind for kind in EventKind if describe(kind, {}) == f"{kind} "]
    assert not fallback


def test_the_configuration_gives_policies_as_enums_with_their_defaults(tmp_path) -> None:
    path = tmp_path / "arbiter.toml"
    path.write_text('device_holder_policy = "terminate"\n[proxmox]\npreemption = "refuse"\n')
    config = load_config(path, environ={})
    assert config.process_policy is ProcessPolicy.TERMINATE
    assert config.proxmox.preemption is Preemption.REFUSE
    assert config.libvirt_preemption is Preemption.STOP
    assert config.console is ConsolePolicy.REFUSE
