"""Progress for the long waits of a claim: stopping a VM, binding a driver.

An `Events` sink.  On a terminal it keeps one live line per step with the
seconds spent so far ("stopping libvirt:win11 (shutdown) … 12 s"), finished
by a tick or a cross; otherwise (a pipe, a log, the journal via stderr) it
writes one plain line when a step starts and one when it ends, so a log shows
where a slow or stuck claim is.
"""

from __future__ import annotations

import threading
import time
from typing import Any, TextIO

from charly_arbiter.core.events import STEP_STARTS, EventKind, describe

# What ends each kind of step, and whether it ended well.
_ENDS = {EventKind.PREEMPTED: True, EventKind.SWITCHED: True, EventKind.RESTORED: True}
_FAILURES = frozenset({EventKind.POISONED, EventKind.FAILED, EventKind.RESTORE_FAILED})
_TICK = 0.5


class Progress:
    def __init__(self, stream: TextIO, terminal: bool | None = None) -> None:
        self.stream = stream
        self.terminal = stream.isatty() if terminal is None else terminal
        self._lock = threading.Lock()
        self._step: str | None = None
        self._started = 0.0
        self._ticker: threading.Thread | None = None
        self._stop_ticking = threading.Event()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        if kind in STEP_STARTS:
            self._begin(describe(kind, fields))
        elif kind in _ENDS or kind in _FAILURES:
            self._end(describe(kind, fields), ok=kind in _ENDS)

    def _begin(self, text: str) -> None:
        self._finish_ticker()
        with self._lock:
            self._step = text
            self._started = time.monotonic()
            if not self.terminal:
                self._write(f"charly-arbiter: {text}\n")
                return
            self._write(f"\r\033[K  {text} …")
        self._stop_ticking.clear()
        self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
        self._ticker.start()

    def _end(self, text: str, ok: bool) -> None:
        self._finish_ticker()
        with self._lock:
            elapsed = time.monotonic() - self._started if self._step else 0.0
            self._step = None
            if not self.terminal:
                self._write(f"charly-arbiter: {text}\n")
                return
            mark = "✓" if ok else "✗"
            self._write(f"\r\033[K{mark} {text} ({elapsed:.1f} s)\n")

    def _tick(self) -> None:
        while not self._stop_ticking.wait(_TICK):
            with self._lock:
                if self._step is None:
                    return
                elapsed = time.monotonic() - self._started
                self._write(f"\r\033[K  {self._step} … {elapsed:.0f} s")

    def _finish_ticker(self) -> None:
        if self._ticker is not None:
            self._stop_ticking.set()
            self._ticker.join()
            self._ticker = None

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
