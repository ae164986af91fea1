"""The ledger's on-disk format: TOML with a schema, a generation and a checksum.

The first line is `checksum = "sha256:HEX"`, the hash of every byte after that
line.  An empty, truncated or bit-flipped file therefore never verifies, and is
never mistaken for a ledger with no leases.  Decoding is strict: every field is
type-checked, and anything unexpected is corruption, not a default.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from typing import Any

from charly_arbiter.core.model import (
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    Poison,
    StepState,
    StoppedHolder,
)
from charly_arbiter.errors import InvalidClaimant

SCHEMA = 2
# Schema 1 (before the writer's start time and a stopped holder's tokens were
# recorded) is read, and written back as schema 2 by the next transaction.
READABLE_SCHEMAS = (1, 2)
_FIRST_LINE = re.compile(rb'checksum = "sha256:([0-9a-f]{64})"\n')


class FormatError(Exception):
    """Why a ledger's bytes are not a valid ledger (wrapped into LedgerCorrupt)."""


def encode(state: LedgerState) -> bytes:
    """Serialize, then re-parse the result in memory before anyone writes it."""
    import tomlkit  # only writers pay for its import; reading uses tomllib

    body = tomlkit.dumps(_to_document(state)).encode("utf-8")
    data = b'checksum = "sha256:' + hashlib.sha256(body).hexdigest().encode() + b'"\n' + body
    if decode(data) != state:
        raise FormatError("the serialized ledger does not read back as the same state")
    return data


def decode(data: bytes) -> LedgerState:
    match = _FIRST_LINE.match(data)
    if match is None:
        what = "empty" if not data else "no checksum line"
        raise FormatError(f"{what} (truncated or not a ledger)")
    body = data[match.end() :]
    if hashlib.sha256(body).hexdigest() != match.group(1).decode():
        raise FormatError("checksum mismatch (the file was changed or damaged)")
    try:
        document = tomllib.loads(body.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError, ValueError) as error:
        raise FormatError(f"not valid TOML: {type(error).__name__}") from error
    try:
        return _from_document(document)
    except (KeyError, TypeError, ValueError, InvalidClaimant) as error:
        raise FormatError(f"unexpected content: {error}") from error


def _to_document(state: LedgerState) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "generation": state.generation,
        "homes": {token: dict(home) for token, home in state.homes},
        "poisoned": {
            token: {"reason": poison.reason, "since": poison.since}
            for token, poison in state.poisoned
        },
        "leases": [_lease_to_table(lease) for lease in state.leases],
    }


def _lease_to_table(lease: Lease) -> dict[str, Any]:
    return {
        "claimant": lease.claimant,
        "mode": lease.mode.value,
        "tokens": list(lease.tokens),
        "state": lease.state.value,
        "transient": lease.transient,
        "boot_id": lease.boot_id,
        "created": lease.created,
        "owner_pid": lease.owner_pid,
        "owner_start": lease.owner_start,
        "note": lease.note,
        "switched": {token: step.value for token, step in lease.switched},
        "stopped": [
            {
                "holder": record.holder,
                "state": record.state.value,
                "shared_tokens": list(record.shared_tokens),
                "restored": record.restored,
                "tokens": list(record.tokens),
            }
            for record in lease.stopped
        ],
    }


def _from_document(document: dict[str, Any]) -> LedgerState:
    schema = _typed(document, "schema", int)
    if schema not in READABLE_SCHEMAS:
        raise ValueError(f"schema {schema} is not one this version reads ({SCHEMA})")
    homes = _typed(document, "homes", dict)
    poisoned = _typed(document, "poisoned", dict)
    return LedgerState(
        generation=_typed(document, "generation", int),
        leases=tuple(_lease_from_table(t, schema) for t in _typed(document, "leases", list)),
        homes=tuple(
            (token, tuple(sorted(_string_map(home).items())))
            for token, home in sorted(homes.items())
        ),
        poisoned=tuple(
            (token, Poison(_typed(p, "reason", str), _typed(p, "since", str)))
            for token, p in sorted(poisoned.items())
        ),
    )


def _lease_from_table(table: Any, schema: int) -> Lease:
    if not isinstance(table, dict):
        raise TypeError("a lease is not a table")
    tokens = tuple(_strings(_typed(table, "tokens", list)))
    return Lease(
        claimant=_typed(table, "claimant", str),
        mode=Mode(_typed(table, "mode", str)),
        tokens=tokens,
        state=LeaseState(_typed(table, "state", str)),
        transient=_typed(table, "transient", bool),
        boot_id=_typed(table, "boot_id", str),
        created=_typed(table, "created", str),
        owner_pid=_typed(table, "owner_pid", int),
        owner_start=_typed(table, "owner_start", int) if schema >= 2 else 0,
        note=_typed(table, "note", str),
        switched=tuple(
            (token, StepState(step))
            for token, step in sorted(_string_map(_typed(table, "switched", dict)).items())
        ),
        stopped=tuple(
            _stopped_from_table(t, schema, tokens) for t in _typed(table, "stopped", list)
        ),
    )


def _stopped_from_table(table: Any, schema: int, lease_tokens: tuple[str, ...]) -> StoppedHolder:
    if not isinstance(table, dict):
        raise TypeError("a stopped holder is not a table")
    shared_tokens = tuple(_strings(_typed(table, "shared_tokens", list)))
    if schema >= 2:
        tokens = tuple(_strings(_typed(table, "tokens", list)))
    else:  # not recorded then: the holder used what it shared, or the lease's tokens
        tokens = shared_tokens or lease_tokens
    return StoppedHolder(
        holder=_typed(table, "holder", str),
        state=StepState(_typed(table, "state", str)),
        shared_tokens=shared_tokens,
        restored=_typed(table, "restored", bool),
        tokens=tokens,
    )


def _typed(table: dict[str, Any], key: str, kind: type) -> Any:
    value = table[key]
    # bool is an int in Python; a ledger that says `generation = true` is corrupt.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _strings(values: list[Any]) -> list[str]:
    if not all(isinstance(value, str) for value in values):
        raise TypeError("expected a list of strings")
    return values


def _string_map(table: dict[str, Any]) -> dict[str, str]:
    if not all(isinstance(value, str) for value in table.values()):
        raise TypeError("expected a table of strings")
    return table
