"""The ledger's on-disk format: TOML with a schema, a generation and a checksum.

The first line is `checksum = "sha256:HEX"`, the hash of every byte after that
line.  An empty, truncated or bit-flipped file therefore never verifies, and is
never mistaken for a ledger with no leases.  Decoding is strict: every field is
type-checked, and anything unexpected is corruption, not a default.
"""

from __future__ import annotations

import hashlib
import json
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
# A lease's sleep locks (`sleep_locks`, `sleep_lock_error`) are optional keys, written
# only when they say something: a ledger from before them reads as leases without
# any, and a lease without any is written as before, byte for byte.
_FIRST_LINE = re.compile(rb'checksum = "sha256:([0-9a-f]{64})"\n')


class FormatError(Exception):
    """Why a ledger's bytes are not a valid ledger (wrapped into LedgerCorrupt)."""


def encode(state: LedgerState) -> bytes:
    """Serialize, then re-parse the result in memory before anyone writes it."""
    body = _dump(_to_document(state)).encode("utf-8")
    data = b'checksum = "sha256:' + hashlib.sha256(body).hexdigest().encode() + b'"\n' + body
    if decode(data) != state:
        raise FormatError("the serialized ledger does not read back as the same state")
    return data


def _dump(document: dict[str, Any]) -> str:
    """The ledger's TOML, written directly: its shape is fixed, and a general writer
    (tomlkit) costs more than the rest of a claim.  `encode` re-parses the result, so
    a mistake here is a refused write, never a wrong ledger."""
    lines = [f"schema = {document['schema']}", f"generation = {document['generation']}"]
    # Empty tables and arrays are top-level keys, which must come before any [table].
    lines += [f"{key} = {{}}" for key in ("homes", "poisoned") if not document[key]]
    lines += ["leases = []"] if not document["leases"] else []
    lines.append("")
    for token, home in document["homes"].items():
        lines.append(f"[homes.{_string(token)}]")
        lines += [f"{_string(address)} = {_string(driver)}" for address, driver in home.items()]
        lines.append("")
    for token, poison in document["poisoned"].items():
        lines.append(f"[poisoned.{_string(token)}]")
        lines += [f"{key} = {_value(value)}" for key, value in poison.items()]
        lines.append("")
    for lease in document["leases"]:
        lines.append("[[leases]]")
        lines += [f"{key} = {_value(value)}" for key, value in lease.items()]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_string(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise FormatError(f"cannot write a {type(value).__name__}")


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def checksum_of(data: bytes) -> str:
    """The ledger's checksum, once it verifies; `FormatError` when it does not."""
    return _verified(data)[0]


def _verified(data: bytes) -> tuple[str, bytes]:
    match = _FIRST_LINE.match(data)
    if match is None:
        what = "empty" if not data else "no checksum line"
        raise FormatError(f"{what} (truncated or not a ledger)")
    digest, body = match.group(1).decode(), data[match.end() :]
    if hashlib.sha256(body).hexdigest() != digest:
        raise FormatError("checksum mismatch (the file was changed or damaged)")
    return digest, body


def decode(data: bytes, cached: bytes | None = None) -> LedgerState:
    """The state in a ledger's bytes.  `cached` is the JSON copy written beside it
    (`encode_cache`): used only when it was made from exactly these bytes and is
    intact itself, since parsing TOML costs a hundred times more than JSON."""
    digest, body = _verified(data)
    if cached is not None:
        state = decode_cache(cached, digest)
        if state is not None:
            return state
    try:
        document = tomllib.loads(body.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError, ValueError) as error:
        raise FormatError(f"not valid TOML: {type(error).__name__}") from error
    try:
        return _from_document(document)
    except (KeyError, TypeError, ValueError, InvalidClaimant) as error:
        raise FormatError(f"unexpected content: {error}") from error


def encode_cache(state: LedgerState, digest: str) -> bytes:
    """A JSON copy of `state`, naming the checksum of the ledger it was made from, with
    a checksum of its own on its first line."""
    body = json.dumps(
        {"ledger": digest, "state": _to_document(state)}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    return b"sha256:" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def decode_cache(data: bytes, digest: str) -> LedgerState | None:
    """The state in a JSON copy made from the ledger with checksum `digest`; None when
    it was made from another generation or does not verify (the TOML decides then)."""
    first, _, body = data.partition(b"\n")
    if first != b"sha256:" + hashlib.sha256(body).hexdigest().encode():
        return None
    try:
        document = json.loads(body)
        if not isinstance(document, dict) or document.get("ledger") != digest:
            return None
        return _from_document(document["state"])
    except (ValueError, KeyError, TypeError, RecursionError, InvalidClaimant):
        return None


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
    optional: dict[str, Any] = {}
    if lease.sleep_locks:
        optional["sleep_locks"] = list(lease.sleep_locks)
    if lease.sleep_lock_error:
        optional["sleep_lock_error"] = lease.sleep_lock_error
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
        **optional,
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
        sleep_locks=tuple(_strings(_optional(table, "sleep_locks", list, []))),
        sleep_lock_error=_optional(table, "sleep_lock_error", str, ""),
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


def _optional(table: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """An optional key of a lease: absent is `default`, present is typed."""
    return _typed(table, key, kind) if key in table else default


def _strings(values: list[Any]) -> list[str]:
    if not all(isinstance(value, str) for value in values):
        raise TypeError("expected a list of strings")
    return values


def _string_map(table: dict[str, Any]) -> dict[str, str]:
    if not all(isinstance(value, str) for value in table.values()):
        raise TypeError("expected a table of strings")
    return table
