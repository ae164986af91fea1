"""Run a write that may block forever, and give up on it after a deadline.

Unbinding `nvidia` while anything holds the GPU can hang in the kernel, even
when no process shows the device open.  The write runs in a daemon thread; past
the timeout the caller gets `SwitchHung` and goes on (the token is poisoned,
nothing more is written to that device).  The stuck thread is abandoned: a
thread blocked in the kernel cannot be cancelled, but the caller never waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from charly_arbiter.errors import SwitchHung

T = TypeVar("T")


def run_with_timeout(
    action: Callable[[], T], timeout: float, address: str, driver: str, step: str
) -> T:
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(action())
        except BaseException as error:  # handed to the caller below
            failure.append(error)

    worker = threading.Thread(target=target, name=f"sysfs {address} {step}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise SwitchHung(address, driver, step, timeout)
    if failure:
        raise failure[0]
    return outcome[0]
