"""Prometheus metrics: the arbiter's state now, and counts from its history.

Written with prometheus-client's own text exposition writer over a private
`CollectorRegistry` (never the global one: no process metrics, no clashes),
for node_exporter's textfile collector or stdout.  Gauges come from
`Arbiter.status`; counters are counted from the history log.  That log is
rotated by size, so a counter can go down after a rotation: Prometheus'
`rate()` and `increase()` take that as a counter reset, which is what it is
(the shipped alerting rules ignore a window that holds one).  The output ends
with the time it was made, so an alert can tell a file nobody rewrites any
more (node_exporter keeps serving it) from a quiet host.

prometheus-client is optional (the `metrics` extra, Debian's
python3-prometheus-client) and imported only here, only when asked for.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from charly_arbiter.core import files
from charly_arbiter.core.arbiter import Status
from charly_arbiter.core.events import EventKind
from charly_arbiter.core.model import Mode
from charly_arbiter.errors import ArbiterError
from charly_arbiter.ops.history import Record

PREFIX = "charly_arbiter"


class MetricsUnavailable(ArbiterError):
    def __init__(self) -> None:
        super().__init__(
            "metrics need the prometheus-client library, which is not installed",
            hint="install python3-prometheus-client (Debian) or `pip install prometheus-client`",
        )


def exposition(status: Status, history: Sequence[Record], skipped_lines: int = 0) -> bytes:
    """The Prometheus text format for this state and history, stamped with the time now."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise MetricsUnavailable() from None
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Collector(status, history, skipped_lines, time.time()))
    data: bytes = generate_latest(registry)
    return data


class _Collector:
    def __init__(
        self, status: Status, history: Sequence[Record], skipped_lines: int, made: float
    ) -> None:
        self.status = status
        self.history = history
        self.skipped_lines = skipped_lines
        self.made = made

    def describe(self) -> list[Any]:
        return []  # families are known only when collected; nothing to check up front

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        status = self.status
        names = [token.name for token in status.tokens]

        leases = GaugeMetricFamily(
            f"{PREFIX}_leases", "Leases holding each token, by mode.", labels=["token", "mode"]
        )
        for token in status.tokens:
            holding = [lease for lease in status.leases if lease.claimant in token.claimants]
            for mode in Mode:
                count = sum(1 for lease in holding if lease.mode is mode)
                leases.add_metric([token.name, str(mode)], count)
        yield leases

        drivers = GaugeMetricFamily(
            f"{PREFIX}_function_driver",
            "1 for the driver each function of a token is bound to now.",
            labels=["token", "address", "driver"],
        )
        for token in status.tokens:
            for address, driver in token.drivers:
                drivers.add_metric([token.name, address, driver or "none"], 1)
        yield drivers

        poisoned = GaugeMetricFamily(
            f"{PREFIX}_token_poisoned",
            "1 when a failed switch poisoned the token (cleared by charly-arbiter's poison clear).",
            labels=["token"],
        )
        for token in status.tokens:
            poisoned.add_metric([token.name], 1 if token.poisoned else 0)
        yield poisoned

        sleep = GaugeMetricFamily(
            f"{PREFIX}_sleep_blocked",
            "1 while a logind inhibitor lock keeps the host from suspending because the token "
            "is passed through.",
            labels=["token"],
        )
        for token in status.tokens:
            sleep.add_metric([token.name], 1 if status.sleep.lock_of(token.name) else 0)
        yield sleep
        yield GaugeMetricFamily(
            f"{PREFIX}_sleep_locks_missing",
            "Passed-through tokens whose sleep lock is not held (no systemd, or stopped from "
            'outside) although sleep = "block".',
            value=len(status.sleep.missing),
        )

        yield GaugeMetricFamily(
            f"{PREFIX}_stranded_claimants",
            "Leases whose claimant is gone (ended by charly-arbiter's restore).",
            value=len(status.stranded),
        )
        stranded = GaugeMetricFamily(
            f"{PREFIX}_lease_stranded", "1 for each stranded claimant.", labels=["claimant"]
        )
        for claimant in status.stranded:
            stranded.add_metric([claimant], 1)
        yield stranded

        yield GaugeMetricFamily(
            f"{PREFIX}_ledger_corrupt",
            "1 when the ledger does not verify.",
            value=1 if status.corrupt else 0,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_ledger_generation", "Writes the ledger has seen.", value=status.generation
        )

        per_token = {
            "claims": (EventKind.CLAIM, "Claims that started (intent recorded), per token."),
            "refusals": (EventKind.REFUSED, "Claims refused by the rules, per token."),
            "switch_failures": (
                EventKind.POISONED,
                "Driver switches that failed and poisoned a token.",
            ),
        }
        for name, (kind, help_text) in per_token.items():
            counts = Counter({token: 0 for token in names})
            for record in self.history:
                if record.kind == kind:
                    counts.update(record.tokens)
            family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=["token"])
            for token_name, count in sorted(counts.items()):
                family.add_metric([token_name], count)
            yield family

        preemptions = CounterMetricFamily(
            f"{PREFIX}_preemptions",
            "Holders stopped to make room for a claim, by holder kind.",
            labels=["kind"],
        )
        kinds = Counter(
            record.get("holder").partition(":")[0]
            for record in self.history
            if record.kind == EventKind.PREEMPTED
        )
        for holder_kind, count in sorted(kinds.items()):
            preemptions.add_metric([holder_kind], count)
        yield preemptions

        restore_failures = sum(
            1 for record in self.history if record.kind == EventKind.RESTORE_FAILED
        )
        yield CounterMetricFamily(
            f"{PREFIX}_restore_failures",
            "Stopped holders that could not be started again.",
            value=restore_failures,
        )

        last_switch = GaugeMetricFamily(
            f"{PREFIX}_last_switch_duration_seconds",
            "How long the last driver switch of each token took.",
            labels=["token"],
        )
        durations: dict[str, float] = {}
        for record in self.history:
            if record.kind == EventKind.SWITCHED:
                try:
                    durations[record.get("token")] = float(record.get("seconds"))
                except ValueError:
                    continue
        for token_name, seconds in sorted(durations.items()):
            last_switch.add_metric([token_name], seconds)
        yield last_switch

        yield GaugeMetricFamily(
            f"{PREFIX}_history_skipped_lines",
            "Torn or unreadable lines skipped in the history log.",
            value=self.skipped_lines,
        )

        # Made after the state above was read: that state is at least this old.
        yield GaugeMetricFamily(
            f"{PREFIX}_metrics_generated_timestamp_seconds",
            "When the metrics command made these metrics (Unix time); stale when it lags.",
            value=self.made,
        )


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` in one step, as node_exporter's textfile collector requires.

    The temp name does not end in `.prom`, so the collector never reads a half
    file; the file is world-readable because node_exporter does not run as root.
    """
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)
    files.replace_file(path, data, temp=temp, mode=0o644)
