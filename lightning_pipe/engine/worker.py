"""Worker threads: one per partition, running its tasks in order, errors returned as values.

A task captures the thread-local state of the code that submitted it (grad mode, autocast) and runs under
it, so a partition on a worker thread behaves as if it ran in the caller's thread. A task's exception is
stored in its future with its traceback; the pipeline re-raises the first one after every task has
finished, so a failing partition never leaves another waiting forever.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

__all__: list[str] = []

_AUTOCAST_DEVICES = ("cpu", "cuda")


def capture_context() -> Callable[[], ContextManager[None]]:
    """Record this thread's grad mode and autocast state; return a factory that re-enters them elsewhere."""
    grad = torch.is_grad_enabled()
    casts = [
        (device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    ]

    def enter() -> ContextManager[None]:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype, cache in casts:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        return stack

    return enter


def autocast_state() -> list[tuple[str, torch.dtype]]:
    """The autocast device types enabled in this thread, with their dtypes (to re-enter in another process)."""
    return [(device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)]


def autocast_context(state: list[tuple[str, torch.dtype]]) -> ContextManager[None]:
    """Enter the autocast ``state`` recorded by :func:`autocast_state`."""
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


_STOP = object()


def _loop(tasks: queue.SimpleQueue[Any], threads: int) -> None:
    # OpenMP keeps its thread count per thread and a new thread starts from the machine's default; PyTorch
    # re-applies torch.set_num_threads only in threads it starts itself, so a worker applies it here.
    torch.set_num_threads(threads)
    while True:
        item = tasks.get()
        if item is _STOP:
            return
        future, fn, context = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            with context():
                result = fn()
        except BaseException as exc:  # noqa: BLE001 - every error goes back to the caller as a value
            future.set_exception(exc)
        else:
            future.set_result(result)
        del item, future, fn, context


class Worker:
    """A daemon thread that runs submitted tasks one after another, in submission order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` to run on this worker under the caller's grad and autocast state."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_loop, args=(self._tasks, torch.get_num_threads()),
                                                name=self.name, daemon=True)
                self._thread.start()
                weakref.finalize(self, self._tasks.put, _STOP)
        future: Future[Any] = Future()
        self._tasks.put((future, fn, capture_context()))
        return future

    def stop(self) -> None:
        """Let the thread finish its queued tasks and exit."""
        self._tasks.put(_STOP)


class Inline:
    """Runs each task at once on the submitting thread (for work that must stay on that thread)."""

    name = "inline"

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` now; its result or exception goes into the returned future."""
        future: Future[Any] = Future()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)
        return future
