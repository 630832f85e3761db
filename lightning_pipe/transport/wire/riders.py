"""What goes to another process with the next message for it: a step's commits and calls on its host, not sent alone.

A driver does not wait for a step's commit (its gradients made aside, added in) in ``loss.backward()``, nor send a
``zero_grad`` on its own: each waits here (a :class:`Rider`) and goes with the next message to that process (a step on
the data plane, a call of its host), which applies it first; whatever needs it done before (:func:`settle_commits`)
sends it alone and waits for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["Rider", "defer_commits", "riding", "riding_along", "rode", "settle_commits"]


# Commits of a step's gradients sent to other processes and not yet known to be done, per pipeline key: a
# driver does not wait for them in ``loss.backward()``; whatever it asks of those processes next for the
# pipeline waits for them first (RPCs to one process are not ordered), and raises their error, located.
_COMMITS: dict[str, list[Future[Any]]] = {}


def defer_commits(key: str, futures: Sequence[Future[Any]]) -> None:
    """Remember ``futures`` (commits in flight to pipeline ``key``'s other processes) until :func:`settle_commits`."""
    _COMMITS.setdefault(key, []).extend(futures)


def settle_commits(key: str, before_steps: bool = False, peer: str | None = None, shares: bool = True) -> None:
    """Wait for the commits in flight to pipeline ``key``'s other processes; raise the first one's error. One not
    sent yet (see :func:`riding`) is sent now, alone. ``before_steps``: leave those that the next step cannot
    overtake (sent on the data plane to the process's step listener, which runs them in order, or waiting to go with
    that step), to be settled once that step is done. ``peer``: only the commits to that process (and those whose
    process is not known). ``shares=False``: leave the steps a process did not answer (those whose ``shares`` is
    true), for what must not overtake them."""
    kept: list[Any] = []
    due: list[Any] = []
    for commit in _COMMITS.pop(key, []):
        later = (before_steps and getattr(commit, "before_steps", False)) or \
            (peer is not None and getattr(commit, "peer", peer) != peer) or \
            (not shares and getattr(commit, "shares", False))
        (kept if later else due).append(commit)
    if kept:
        _COMMITS[key] = kept
    for commit in due:
        commit.result()


class Rider:
    """Something for process ``peer`` not sent yet (among the commits, :func:`defer_commits`): it goes with the next
    message to that process (:func:`riding`), which applies its :attr:`rider` before anything else and answers for
    it; where something needs it done first (:func:`settle_commits`), :meth:`result` sends it alone
    (:meth:`send_alone`) and waits."""

    peer: str
    unsent = True  # False once it went, alone or with another message
    _sent: Any = None  # what it became when sent alone: a ``result()`` to wait for

    @property
    def rider(self) -> tuple[Any, ...]:
        """What goes with the other message: ``("commit", run, scale)`` or ``("call", method, args)``."""
        raise NotImplementedError

    @property
    def before_steps(self) -> bool:
        """Whether the next step cannot overtake it: not sent yet (it goes with that step)."""
        return self._sent is None

    def send_alone(self) -> Any:
        """Send it on its own; what to wait for (with ``result()``)."""
        raise NotImplementedError

    def result(self) -> None:
        """Send it alone, unless it went already, and wait for its answer; raise its error, located."""
        if self._sent is None:
            if not self.unsent:
                return  # it went with another message, which answered for it
            self.unsent = False
            self._sent = self.send_alone()
        self._sent.result()


def riding(key: str, peer: str) -> list[Any]:
    """The commits to process ``peer`` of pipeline ``key`` not sent yet: those :func:`defer_commits` got whose
    ``unsent`` is true, for the caller to send with its next message to that process, which applies them before
    anything else and answers for them (see :func:`rode`)."""
    return [c for c in _COMMITS.get(key, ()) if getattr(c, "peer", None) == peer and getattr(c, "unsent", False)]


def rode(key: str, commits: Sequence[Any]) -> None:
    """Forget ``commits`` (from :func:`riding`): they went with a message whose answer reports their errors."""
    _COMMITS[key] = [c for c in _COMMITS.get(key, []) if not any(c is r for r in commits)]
    for commit in commits:
        commit.unsent = False


@contextlib.contextmanager
def riding_along(key: str, peer: str) -> Iterator[list[tuple[Any, ...]]]:
    """The commits to process ``peer`` of pipeline ``key`` not sent yet (each its ``rider``: ``("commit", run, scale)``
    or ``("call", method, args)``), for the message the caller sends it inside, which applies them first, in order,
    and answers for them; kept for the next message where sending raises. The commits in flight to ``peer`` are
    waited for before."""
    commits = riding(key, peer)
    rode(key, commits)
    try:
        settle_commits(key, peer=peer)
        yield [c.rider for c in commits]
    except BaseException:
        for commit in commits:
            commit.unsent = True
        defer_commits(key, commits)
        raise
