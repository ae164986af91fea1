"""`metrics`: Prometheus text exposition on stdout, or atomically into a file."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from charly_arbiter.cli.app import App
from charly_arbiter.errors import ArbiterError
from charly_arbiter.ops.history import HistoryLog
from charly_arbiter.ops.metrics import exposition, write_atomically


@click.command()
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write here atomically (e.g. /var/lib/prometheus/node-exporter/charly-arbiter.prom).",
)
@click.pass_obj
def metrics(app: App, output: Path | None) -> None:
    """Write Prometheus metrics: leases, poison, stranded claimants, event counts."""
    status = app.arbiter().status()
    reading = HistoryLog(app.config().state_dir).read()
    data = exposition(status, reading.records, skipped_lines=len(reading.notes))
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    try:
        write_atomically(output, data)
    except OSError as error:
        raise ArbiterError(
            f"could not write the metrics to {output}: {error.strerror}",
            hint=f"check that {output.parent} exists and is writable",
        ) from error
