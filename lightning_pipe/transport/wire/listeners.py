"""The step listeners' threads, which the program's exit waits for: a process that left under one was aborted."""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_WAIT", "start_listener"]

EXIT_WAIT = 30.0  #: s: how long a program's exit waits for step listeners still waiting on their driver
_LISTENERS: set[threading.Thread] = set()  # the step listeners of this process still serving


def _join_listeners() -> None:
    """As the program exits, wait (at most :data:`EXIT_WAIT`) for the step listeners still serving: one whose driver
    did not close its pipeline before ``rpc.shutdown`` waits in a receive until that process exits (its channel
    then fails, and it ends), and a process leaving under it was ended by gloo's threads (``terminate called without
    an active exception``, exit code -6) though its work was done."""
    deadline = time.monotonic() + EXIT_WAIT
    for thread in list(_LISTENERS):
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_join_listeners)


def start_listener(name: str, listen: Callable[[], None]) -> threading.Thread:
    """``listen`` started on a daemon thread named ``name``, which the program's exit waits for (at most
    :data:`EXIT_WAIT`) while it runs."""

    def run() -> None:
        try:
            listen()
        finally:
            _LISTENERS.discard(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    _LISTENERS.add(thread)
    thread.start()
    return thread
