"""What Prometheus scrapes from one simulated host, minute by minute, turned into
`input_series` for `promtool test rules`.

Every value comes from the real `charly-arbiter metrics --output FILE` (the
command charly-arbiter-metrics.timer runs every minute), read back with
prometheus-client's own parser of the text format.  The clock is promtool's: it
starts at 0, and node_exporter is scraped once a minute.  A minute is one of:

- `write()`: the timer runs the real command now and the scrape reads the new file;
- `rewritten(n)`: nothing happens on the host for n minutes while the timer keeps
  writing.  A write of an unchanged state differs from the last one only in the
  time it was made (test_alert_rules checks that on the real command), so the
  last file is scraped again with that time moved on to each minute;
- `unwritten(n)`: the timer has stopped: node_exporter keeps serving the same
  file, the time it was made included.

The one value that depends on the wall clock, the time the file was made
(`charly_arbiter_metrics_generated_timestamp_seconds`), is moved from the real
time the command ran to the minute it stands for, keeping its offset from the
start of the run; every other value goes through as it was read.  A series
that is in one scrape and not in the next gets Prometheus' staleness marker
(`stale`), as a real scrape would give it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]
Samples = dict[Key, float]

MINUTE = 60.0
STAMP = "charly_arbiter_metrics_generated_timestamp_seconds"
STAMP_KEY: Key = (STAMP, ())


def parse(text: str) -> Samples:
    """Every sample of a text exposition, as Prometheus stores it (name, labels)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"{key} twice in one exposition"
            samples[key] = float(sample.value)
    return samples


def exported_names(text: str) -> set[str]:
    """The metric names an exposition gives Prometheus, a family without samples included."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffix = "_total" if family.type == "counter" else ""
        names |= {sample.name for sample in family.samples} or {family.name + suffix}
    return names


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class Scrapes:
    """The scrapes of one host's node_exporter: the arbiter's textfile, plus any
    other collector's samples (`also`, called at each scrape)."""

    def __init__(self, sim: Any, textfile: Path, *also: Callable[[], Samples]) -> None:
        self.sim = sim
        self.textfile = textfile
        self.also = also
        self.taken: list[Samples] = []
        self._file: tuple[Samples, float] | None = None  # as read, and when its run started
        self._written = 0  # the minute of the last write

    @property
    def minute(self) -> int:
        """The minute the next scrape happens at."""
        return len(self.taken)

    def write(self) -> Samples:
        """The timer runs `charly-arbiter metrics --output FILE` now; returns what it wrote."""
        started = time.time()
        self.sim.cli("metrics", "--output", str(self.textfile), check=True)
        finished = time.time()
        samples = parse(self.textfile.read_text())
        assert started <= samples[STAMP_KEY] <= finished, (
            "the file says it was made at another time"
        )
        self._file = (samples, started)
        self._scrape(written=self.minute)
        return samples

    def rewritten(self, minutes: int) -> None:
        for _ in range(minutes):
            self._scrape(written=self.minute)

    def unwritten(self, minutes: int) -> None:
        for _ in range(minutes):
            self._scrape(written=self._written)

    def _scrape(self, written: int) -> None:
        assert self._file is not None, "nothing was written yet"
        samples, started = self._file
        scraped = dict(samples)
        scraped[STAMP_KEY] = samples[STAMP_KEY] - started + written * MINUTE
        for source in self.also:
            scraped.update(source())
        self._written = written
        self.taken.append(scraped)

    def input_series(self, target: Mapping[str, str]) -> list[dict[str, str]]:
        """promtool's `input_series`, one value a minute; `target` holds the labels
        Prometheus adds to every sample of the scrape (instance, job)."""
        keys = sorted({key for scrape in self.taken for key in scrape})
        series = []
        for name, labels in keys:
            assert not set(target) & {label for label, _ in labels}, (name, labels)
            values: list[str] = []
            for scrape in self.taken:
                if (name, labels) in scrape:
                    values.append(repr(scrape[(name, labels)]))
                elif values and values[-1] not in ("_", "stale"):
                    values.append("stale")  # gone since the last scrape
                else:
                    values.append("_")
            selector = {**dict(labels), **target}
            series.append({"series": name + _labels(selector), "values": " ".join(values)})
        return series


def _labels(labels: Mapping[str, str]) -> str:
    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    return "{" + ", ".join(f"{name}={quoted(labels[name])}" for name in sorted(labels)) + "}"
